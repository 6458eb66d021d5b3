"""The CPU kernels of a git revision against the working tree's, alternated in one run.

Each measurement runs in a fresh process (the kernels are one library per process) built
from either ``--base``'s ``neuron_runtime/backends/cpu_kernels.c`` or the working tree's, in
the order base, new, base, new, ... so background load on a shared box hits both alike:

- decode attention alone, one layer of the default model's shape (9 query heads over 3 KV
  heads of 64, 16-token blocks) at one sequence of each ``--contexts`` length: microseconds
  per call, best of many calls;
- the offline engine's decode step (default model, fp32, greedy, ignore_eos): TPOT = (time
  for N tokens - time for 1 token) / (N - 1) of a batch of ``B`` prompts of ``P`` tokens,
  for each ``B:P`` in ``--steps``, best of two.

Prints medians over ``--repeats`` alternations and new / base ratios (below 1: new is
faster), and writes JSON.

    python bench/kernels_ab.py --base HEAD~1 [--threads 1] [--repeats 2]
        [--contexts 64,256,1024] [--steps 1:40,1:1000,16:500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from threads import cpu_model, uptime  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "neuron_runtime/backends/cpu_kernels.c"


def measure(source: str, threads: int, contexts: list[int], steps: list[tuple[int, int]]) -> dict:
    """One process's figures with the kernels built from ``source`` ('' = the working tree)."""
    import torch

    import neuron_runtime.backends.cpu_kernels as ck

    if source:
        ck.SOURCE = Path(source)
    torch.set_num_threads(1)
    k = ck.kernels()
    assert k is not None, "the CPU kernels did not build"
    k.set_num_threads(threads)
    out: dict = {}
    kv_heads, heads, d, block_size = 3, 9, 64, 16
    for ctx in contexts:
        blocks = -(-ctx // block_size)
        k_cache = torch.randn(kv_heads, blocks, block_size, d)
        v_cache = torch.randn(kv_heads, blocks, block_size, d)
        q = torch.randn(1, heads, d)
        table = torch.arange(blocks).view(1, -1)
        lens = torch.tensor([ctx])
        calls = max(20, 200_000 // ctx)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                k.decode_attention(q, k_cache, v_cache, table, lens, d**-0.5, None, None)
            best = min(best, (time.perf_counter() - start) / calls)
        out[f"attention ctx {ctx} (us)"] = best * 1e6

    from neuron_runtime import LLM, SamplingParams

    llm = LLM(model="smollm2-135m-instruct", max_model_len=2048, num_threads=threads)
    tokens = 64
    for batch, prompt_len in steps:
        prompts = [[1000 + (i * 7 + j) % 5000 for i in range(prompt_len)] for j in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        best = float("inf")
        for _ in range(2):
            one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompts, one)
            first = time.perf_counter() - start
            many = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompts, many)
            best = min(best, (time.perf_counter() - start - first) / (tokens - 1))
        out[f"TPOT batch {batch} prompt {prompt_len} (ms)"] = best * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to compare with")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--contexts", default="64,256,1024")
    parser.add_argument("--steps", default="1:40,1:1000,16:500", help="batch:prompt tokens")
    parser.add_argument("--json", default="bench/results/kernels_ab.json")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",") if c]
    steps = [tuple(int(v) for v in s.split(":")) for s in args.steps.split(",") if s]
    if args.child is not None:
        print(json.dumps(measure(args.child, args.threads, contexts, steps)))  # type: ignore[arg-type]
        return

    base_source = subprocess.run(
        ["git", "show", f"{args.base}:{KERNELS}"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    before = uptime()
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        base_path = Path(tmp) / "cpu_kernels.c"
        base_path.write_bytes(base_source)
        for _ in range(args.repeats):
            for name, source in (("base", str(base_path)), ("new", "")):
                cmd = [sys.executable, __file__, "--child", source, "--threads", str(args.threads)]
                cmd += ["--contexts", args.contexts, "--steps", args.steps]
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
                runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"{name}: {runs[name][-1]}", flush=True)
    print(f"\nCPU {cpu_model()}; {before} -> {uptime()}; {args.threads} thread(s)")
    print(f"base = {args.base}, new = the working tree; medians of {args.repeats}\n")
    print("| figure | base | new | new / base |\n|---|---|---|---|")
    table = {}
    for key in runs["base"][0]:
        base = statistics.median(r[key] for r in runs["base"])
        new = statistics.median(r[key] for r in runs["new"])
        table[key] = {"base": base, "new": new, "ratio": new / base}
        print(f"| {key} | {base:.1f} | {new:.1f} | {new / base:.2f} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps({"cpu": cpu_model(), "base": args.base, "runs": runs, "table": table}, indent=1)
    )


if __name__ == "__main__":
    main()
