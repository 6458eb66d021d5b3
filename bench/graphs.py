"""Eager vs compiled graphs (the static runner) side by side: TPOT, tok/s and compile times.

Two engines on the same weights, one eager (on CPU: the fused C kernels) and one with
``graph_mode`` (default inductor) over buckets that fit the batch sizes measured. Runs
alternate (eager, graphs, eager, graphs, ...) so background load hits both alike; the script
reports medians and the ratio, checks that both produced the same greedy tokens, and lists
the warm-up time of every graph. For each batch size B:

- TPOT: (time for B requests of N output tokens - time for B requests of 1 token) / (N - 1)
- tok/s: B * N output tokens / the time of the N-token run (prefill included)

``--random-weights`` loads the model folder's config and tokenizer only and draws random
weights of that shape (the timing of the real model where its weights cannot travel, e.g. to
a GPU host).

    python bench/graphs.py [--model smollm2-135m-instruct] [--device cpu|cuda]
        [--graph-mode inductor] [--compile-scope layer|step] [--batches 1,8,32]
        [--tokens 32] [--repeats 3] [--random-weights] [--max-top-k K] [--num-threads N]
        [--json bench/results/graphs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from threads import cpu_model, uptime

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.model_store import resolve_model

PROMPT = "Write a short story about a lighthouse keeper number {i} and the sea."
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def random_copy(folder: Path, out: Path) -> Path:
    """``folder``'s architecture and tokenizer with seeded random weights (wide enough init
    that greedy choices are not near-ties)."""
    import shutil

    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    config.initializer_range = 0.2
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (folder / name).exists():
            shutil.copy(folder / name, out / name)
    return out


def run(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--graph-mode", default="inductor")
    parser.add_argument("--compile-scope", default=None)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--max-top-k", type=int, default=None, help="the static sampler's bound")
    parser.add_argument("--num-threads", type=int, default=None, help="default: usable cores")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    batches = [int(b) for b in args.batches.split(",")]
    path = resolve_model(args.model)
    if args.random_weights:
        path = random_copy(path, Path(tempfile.mkdtemp(prefix="graphs-bench-")))
    limits = dict(
        max_model_len=256,
        max_num_seqs=max(batches),
        max_num_batched_tokens=256,
        device=args.device,
        enable_prefix_caching=False,
        num_threads=args.num_threads,
    )
    print(f"CPU: {cpu_model()}; {uptime()}")
    eager = LLM(model=str(path), **limits)
    start = time.perf_counter()
    graphs = LLM(
        model=str(path),
        **limits,
        graph_mode=args.graph_mode,
        compile_scope=args.compile_scope,
        seq_buckets=sorted(set(batches)),
        token_buckets=[32, 256],
        context_buckets=[4, 16],
        on_recompile="error",
        max_top_k=args.max_top_k,
    )
    warm_up_s = time.perf_counter() - start
    static = graphs.engine.runner.static
    assert static is not None
    tok = eager.get_tokenizer()
    rows = []
    identical = True
    for batch in batches:
        prompts = [tok.encode(PROMPT.format(i=i)) for i in range(batch)]
        times: dict[str, dict[str, list[float]]] = {
            "eager": {"n": [], "one": []},
            "graphs": {"n": [], "one": []},
        }
        outputs: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):
            for name, llm in (("eager", eager), ("graphs", graphs)):
                one, _ = run(llm, prompts, 1)
                full, out = run(llm, prompts, args.tokens)
                times[name]["one"].append(one)
                times[name]["n"].append(full)
                outputs[name] = out
        identical &= outputs["eager"] == outputs["graphs"]
        row: dict[str, float | int] = {"batch": batch}
        for name in ("eager", "graphs"):
            full = statistics.median(times[name]["n"])
            one = statistics.median(times[name]["one"])
            row[f"{name}_tpot_ms"] = 1000 * (full - one) / (args.tokens - 1)
            row[f"{name}_tok_s"] = batch * args.tokens / full
        row["tpot_ratio"] = row["eager_tpot_ms"] / row["graphs_tpot_ms"]
        rows.append(row)
    print(
        f"\n{args.device}, graph_mode {args.graph_mode}, scope {graphs.engine.config.graph.scope}"
    )
    print("| batch | eager TPOT | graphs TPOT | eager tok/s | graphs tok/s | eager/graphs TPOT |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['eager_tpot_ms']:.1f} ms | {r['graphs_tpot_ms']:.1f} ms | "
            f"{r['eager_tok_s']:.1f} | {r['graphs_tok_s']:.1f} | {r['tpot_ratio']:.2f}x |"
        )
    print(f"\ngreedy tokens identical: {identical}; compiles after warm-up: ", end="")
    print(static.num_compiles_after_warm_up)
    print(f"warm-up {warm_up_s:.1f} s in all; per graph:")
    for name, seconds in static.compile_seconds.items():
        print(f"  {name}: {seconds:.1f} s")
    print(f"{uptime()}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        result = {
            "cpu": cpu_model(),
            "device": args.device,
            "graph_mode": args.graph_mode,
            "rows": rows,
            "identical": identical,
            "warm_up_s": warm_up_s,
            "compile_seconds": static.compile_seconds,
        }
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
