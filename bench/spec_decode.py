"""Speculative decoding on the embedded model: acceptance rate and TPOT with and without
each proposer, at batch 1 and 8, on repetitive and free-form chat workloads.

- repetitive: a code edit (the model rewrites a function it was given) and a
  summarise-and-quote request (the answer quotes the prompt's sentences);
- free-form: a story with nothing to copy from the prompt.

Configurations: no speculation, n-gram (prompt lookup), and self-speculation with the
target's first layers (no trained draft or EAGLE head exists offline, so those proposers
have nothing to show here beyond correctness). Greedy, fp32; every configuration's greedy
tokens are checked against no speculation. Configurations alternate within each repeat
(A B C A B C ...) and the table reports medians.

TPOT per request = (finish - first token) / (output tokens - 1); acceptance = accepted draft
tokens / draft tokens; tokens per verify step = 1 + accepted / drafts. On the shared 2-vCPU
box the TPOT ratios move by tens of percent with the other processes' load (compare the rows
of a configuration that drafts nothing); acceptance and tokens per step do not depend on it.

    python bench/spec_decode.py [--repeats 3] [--max-tokens 96] [--threads 2]
        [--json bench/results/spec_decode.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from neuron_runtime.engine import LLMEngine
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.outputs import RequestOutputKind
from neuron_runtime.sampling_params import SamplingParams

CODE = '''def moving_average(values, window):
    """Returns the moving averages of values over a window."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages
'''
ARTICLE = (
    "The lighthouse at Point Ayre was built in 1818. Its light can be seen from twenty miles "
    "away. In 1890 a fog horn was added on the cliff below it. The keepers left in 1994, when "
    "the light was automated. Today the buildings are holiday cottages."
)
WORKLOADS = {
    "repetitive": [
        f"Here is a Python function:\n\n{CODE}\nRewrite it with the variable `total` renamed "
        "to `acc`. Output the full code in a code block.",
        f"Summarise this text, quoting each sentence exactly:\n\n{ARTICLE}",
    ],
    "free-form": [
        "Write a short story about a fox who learns to sail.",
        "Describe your ideal weekend in a few sentences.",
    ],
}
CONFIGS: dict[str, dict | None] = {
    "none": None,
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    "ngram k=4 no backoff": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
        "min_acceptance_rate": 0.0,
    },
    "ngram k=4 <=2 seqs": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
        "disable_by_batch_size": 2,
    },
    "self-spec 10/30 k=2": {
        "method": "draft_model",
        "num_speculative_tokens": 2,
        "num_draft_layers": 10,
    },
}


def run_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Runs the prompts together; per-request TPOT and the step's token ids."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    before = engine.stats().spec_decode
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params, RequestOutputKind.DELTA)
        tokens[str(i)] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            new = out.outputs[0].token_ids
            if new and out.request_id not in first:
                first[out.request_id] = now
            tokens[out.request_id].extend(new)
            if out.finished:
                done[out.request_id] = now
    tpots = [(done[r] - first[r]) / (len(tokens[r]) - 1) for r in tokens if len(tokens[r]) > 1]
    after = engine.stats().spec_decode
    drafted = accepted = drafts = 0
    if after is not None:
        drafted = after.num_draft_tokens - (before.num_draft_tokens if before else 0)
        accepted = after.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
        drafts = after.num_drafts - (before.num_drafts if before else 0)
    return {
        "tpot_s": statistics.mean(tpots),
        "tokens": [tokens[str(i)] for i in range(len(prompts))],
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "drafts": drafts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--json", default="bench/results/spec_decode.json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    engines = {
        name: LLMEngine.from_engine_args(
            EngineArgs(
                max_model_len=1024,
                num_kv_blocks=1024,
                num_threads=args.threads,
                enable_prefix_caching=False,
                speculative_config=spec,
            )
        )
        for name, spec in CONFIGS.items()
    }
    tokenizer = engines["none"].tokenizer
    prompts = {
        w: [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in texts]
        for w, texts in WORKLOADS.items()
    }
    # [workload][batch][config] -> list of runs
    runs: dict = {w: {b: {c: [] for c in CONFIGS} for b in batches} for w in WORKLOADS}
    for engine in engines.values():  # warm-up
        run_batch(engine, prompts["free-form"][:1], 4)
    names = list(engines)
    for repeat in range(args.repeats):
        # Each repeat starts with another configuration: load that drifts does not favour one.
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for workload, texts in prompts.items():
            for batch in batches:
                batch_prompts = [texts[i % len(texts)] for i in range(batch)]
                for name in order:
                    engine = engines[name]
                    runs[workload][batch][name].append(
                        run_batch(engine, batch_prompts, args.max_tokens)
                    )

    cpu = (
        subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True)
        .stdout.split(":")[-1]
        .strip()
    )
    print(f"CPU: {cpu}; load average {os.getloadavg()}; threads {args.threads}")
    header = f"{'workload':<11} {'batch':>5} {'config':<20} {'TPOT ms':>8} {'vs none':>8} "
    header += f"{'accept':>7} {'tok/step':>8} {'greedy ==':>9}"
    print(header)
    rows = []
    for workload in WORKLOADS:
        for batch in batches:
            base = statistics.median(r["tpot_s"] for r in runs[workload][batch]["none"])
            base_tokens = runs[workload][batch]["none"][0]["tokens"]
            for name in CONFIGS:
                rs = runs[workload][batch][name]
                tpot = statistics.median(r["tpot_s"] for r in rs)
                drafted = sum(r["draft_tokens"] for r in rs)
                accepted = sum(r["accepted_tokens"] for r in rs)
                drafts = sum(r["drafts"] for r in rs)
                same = all(r["tokens"] == base_tokens for r in rs)
                row = {
                    "workload": workload,
                    "batch": batch,
                    "config": name,
                    "tpot_ms": tpot * 1e3,
                    "speedup": base / tpot,
                    "acceptance": accepted / drafted if drafted else None,
                    "tokens_per_step": 1 + accepted / drafts if drafts else None,
                    "greedy_identical": same,
                }
                rows.append(row)
                acc = f"{row['acceptance']:.2f}" if drafted else "-"
                per_step = f"{row['tokens_per_step']:.2f}" if drafts else "-"
                print(
                    f"{workload:<11} {batch:>5} {name:<20} {tpot * 1e3:>8.1f} "
                    f"{base / tpot:>7.2f}x {acc:>7} {per_step:>8} {str(same):>9}"
                )
    result = {
        "cpu": cpu,
        "platform": platform.platform(),
        "load_average": os.getloadavg(),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "rows": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
