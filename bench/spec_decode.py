"""Speculative decoding on the embedded model: acceptance rate and TPOT with and without
each proposer, at batch 1 and 8, on repetitive and free-form chat workloads.

- repetitive: a code edit (the model rewrites a function it was given) and a
  summarise-and-quote request (the answer quotes the prompt's sentences);
- free-form: a story with nothing to copy from the prompt.

Configurations: n-gram (prompt lookup; with and without back-off, or disabled above 2
sequences) and self-speculation with the target's first layers (no trained draft or EAGLE
head exists offline, so those proposers have nothing to show here beyond correctness), each
against no speculation. Greedy, fp32; every run's greedy tokens are checked against no
speculation.

Each row is ``--repeats`` A/B pairs on one engine: a run with its speculation switched off
(A) and one with it (B) right after it, the order flipping from pair to pair (A B, B A, ...), so
load that drifts on the shared box favours neither. The speedup of a pair is A's TPOT / B's;
a row prints the median over its pairs with the smallest and largest (the spread). The goals
(issue 24): n-gram >= 1.5x on the repetitive workload at batch 1, and >= 0.95x (never more
than 5% slower) on the free-form one.

TPOT per request = (finish - first token) / (output tokens - 1); acceptance = accepted draft
tokens / draft tokens; tokens per verify step = 1 + accepted / drafts. The CPU-time speedup
is the same ratio in this process's CPU seconds after every request's first token: the work
each engine did, which other processes' load moves far less than wall time (with
``--threads 1``; spinning pool threads count too).

    python bench/spec_decode.py [--repeats 6] [--max-tokens 96] [--threads 2]
        [--batches 1,8] [--workloads repetitive,free-form] [--configs "ngram k=4"]
        [--json bench/results/spec_decode.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Iterator
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
CONFIGS: dict[str, dict] = {
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
    cpu_start: float | None = None  # process CPU time once every request has its first token
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
        if cpu_start is None and len(first) == len(prompts):
            cpu_start = time.process_time()
    assert cpu_start is not None
    cpu_s = time.process_time() - cpu_start
    tpots = [(done[r] - first[r]) / (len(tokens[r]) - 1) for r in tokens if len(tokens[r]) > 1]
    after = engine.stats().spec_decode
    drafted = accepted = drafts = 0
    if after is not None:
        drafted = after.num_draft_tokens - (before.num_draft_tokens if before else 0)
        accepted = after.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
        drafts = after.num_drafts - (before.num_drafts if before else 0)
    return {
        "tpot_s": statistics.mean(tpots),
        "decode_cpu_s": cpu_s,
        "tokens": [tokens[str(i)] for i in range(len(prompts))],
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "drafts": drafts,
    }


@contextlib.contextmanager
def speculation_off(engine: LLMEngine) -> Iterator[None]:
    """The same engine without its SpecDecoder: the same weights and KV cache in memory, so
    the A and B runs differ in speculation only (two engines' copies of the weights can sit
    differently in memory and run at persistently different speeds)."""
    spec = engine.spec
    engine.spec = engine.runner.spec = None
    try:
        yield
    finally:
        engine.spec = engine.runner.spec = spec


def ab_runs(
    engine: LLMEngine, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[list[dict], list[dict]]:
    """``--repeats`` pairs of runs of ``engine`` without speculation (A) and with it (B), one
    right after the other, the order flipping each pair (A B, B A, ...) so drift favours
    neither."""
    plain: list[dict] = []
    spec: list[dict] = []
    for repeat in range(args.repeats):
        for speculate in (False, True) if repeat % 2 == 0 else (True, False):
            if speculate:
                spec.append(run_batch(engine, prompts, args.max_tokens))
            else:
                with speculation_off(engine):
                    plain.append(run_batch(engine, prompts, args.max_tokens))
    return plain, spec


def spread(values: list[float]) -> str:
    """``median [min, max]``."""
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=6, help="A/B pairs per row")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument(
        "--configs", default="ngram k=4", help=f"comma-separated, of: {', '.join(CONFIGS)}"
    )
    parser.add_argument("--json", default="bench/results/spec_decode.json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    workloads = args.workloads.split(",")
    configs = args.configs.split(",")
    for name in configs:
        if name not in CONFIGS:
            parser.error(f"unknown config {name!r}")

    engines = {
        name: LLMEngine.from_engine_args(
            EngineArgs(
                max_model_len=1024,
                num_kv_blocks=1024,
                num_threads=args.threads,
                enable_prefix_caching=False,
                speculative_config=CONFIGS[name],
            )
        )
        for name in configs
    }
    tokenizer = engines[configs[0]].tokenizer
    prompts = {
        w: [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in WORKLOADS[w]]
        for w in workloads
    }
    for engine in engines.values():  # warm-up
        run_batch(engine, prompts[workloads[0]][:1], 4)

    cpu = (
        subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True)
        .stdout.split(":")[-1]
        .strip()
    )
    load_before = os.getloadavg()
    start = time.perf_counter()
    header = f"{'workload':<11} {'batch':>5} {'config':<20} {'TPOT ms none':>12} "
    header += f"{'TPOT ms spec':>12} {'speedup median [min, max]':>26} "
    header += f"{'CPU-time speedup':>26} {'accept':>7} "
    header += f"{'tok/step':>8} {'greedy ==':>9}"
    print(header)
    rows = []
    for workload in workloads:
        for batch in batches:
            texts = prompts[workload]
            batch_prompts = [texts[i % len(texts)] for i in range(batch)]
            for name in configs:
                plain, spec = ab_runs(engines[name], batch_prompts, args)
                # One speedup per A/B pair: none's TPOT / the speculating engine's.
                ratios = [a["tpot_s"] / b["tpot_s"] for a, b in zip(plain, spec, strict=True)]
                # The same in CPU seconds of this process after the first tokens: the work
                # done, less moved by other processes' load than wall time.
                cpu_ratios = [
                    a["decode_cpu_s"] / b["decode_cpu_s"] for a, b in zip(plain, spec, strict=True)
                ]
                drafted = sum(r["draft_tokens"] for r in spec)
                accepted = sum(r["accepted_tokens"] for r in spec)
                drafts = sum(r["drafts"] for r in spec)
                same = all(r["tokens"] == plain[0]["tokens"] for r in plain + spec)
                row = {
                    "workload": workload,
                    "batch": batch,
                    "config": name,
                    "tpot_ms_none": [r["tpot_s"] * 1e3 for r in plain],
                    "tpot_ms_spec": [r["tpot_s"] * 1e3 for r in spec],
                    "speedups": ratios,
                    "speedup_median": statistics.median(ratios),
                    "cpu_speedups": cpu_ratios,
                    "cpu_speedup_median": statistics.median(cpu_ratios),
                    "acceptance": accepted / drafted if drafted else None,
                    "tokens_per_step": 1 + accepted / drafts if drafts else None,
                    "greedy_identical": same,
                }
                rows.append(row)
                acc = f"{row['acceptance']:.2f}" if drafted else "-"
                per_step = f"{row['tokens_per_step']:.2f}" if drafts else "-"
                none_ms = statistics.median(row["tpot_ms_none"])
                spec_ms = statistics.median(row["tpot_ms_spec"])
                print(
                    f"{workload:<11} {batch:>5} {name:<20} {none_ms:>12.1f} {spec_ms:>12.1f} "
                    f"{spread(ratios):>26} {spread(cpu_ratios):>26} {acc:>7} {per_step:>8} "
                    f"{str(same):>9}",
                    flush=True,
                )
    print(
        f"CPU: {cpu}; load average before {load_before}, after {os.getloadavg()}; "
        f"threads {args.threads}; {args.repeats} A/B pairs per row; "
        f"{time.perf_counter() - start:.0f} s"
    )
    result = {
        "cpu": cpu,
        "platform": platform.platform(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
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
