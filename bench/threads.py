"""Thread scaling of the offline engine: the same engine at 1 and 2 (or more) threads.

One engine (default model, fp32, greedy, ignore_eos, no prefix caching); between runs the
CPU kernels' pool is resized as ``num_threads`` sizes it, torch's intra-op pool kept at one
thread as the CPU backend keeps it beside the kernels. A thread count written ``2t`` gives
torch's pool the same count too, to measure what that costs. Settings alternate on every
repeat (1, 2, 1, 2, ...) so background load on a shared box hits them alike; the script
reports medians, the ratios to the first setting, and checks that every setting produced the
same tokens. ``--modules`` adds, for every setting, the same engine with its decode steps
run through the model's modules instead of one ``decode_step`` call (backends/cpu_decode.py).
For each batch size B:

- TPOT: (time for B requests of N output tokens - time for B requests of 1 token) / (N - 1),
  the time of one decode step of the whole batch
- tok/s: B * N output tokens / the time of the N-token run (prefill included)
- cores: CPU seconds of this process / wall seconds over the N-token run

    python bench/threads.py [--threads 1,2[,2t]] [--batches 1,8,32] [--tokens 64]
        [--dtypes float32[,bfloat16]] [--modules]
        [--repeats 3] [--json bench/results/threads.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import time
from pathlib import Path

import torch

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.backends.cpu_kernels import kernels

MODULES = "modules"
PROMPT = "Write a short story about a lighthouse keeper number {i} and the sea."


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    return next(
        (line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line),
        platform.machine(),
    )


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return f"load average: {os.getloadavg()}"


def set_threads(setting: str) -> None:
    """What ``num_threads=n`` sets in the CPU backend for "n"; "nt": torch's pool at n too."""
    n = int(setting.removesuffix("t"))
    fused = kernels()
    assert fused is not None
    fused.set_num_threads(n)
    torch.set_num_threads(n if setting.endswith("t") else 1)


def run(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, float, list]:
    """Wall seconds, CPU seconds and the generated token ids of one batch."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start_cpu, start = cpu_s(), time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    return elapsed, cpu_s() - start_cpu, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", default="1,2", help="kernel threads; 2t: torch's too")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dtypes",
        default="float32",
        help="one engine per dtype (EngineArgs.dtype), each run at every thread setting in turn",
    )
    parser.add_argument(
        "--modules",
        action="store_true",
        help="also run every setting with decode steps through the model's modules "
        "(no one-call decode_step: backends/cpu_decode.py)",
    )
    parser.add_argument("--json", default="bench/results/threads.json")
    args = parser.parse_args()
    thread_settings = args.threads.split(",")
    dtypes = args.dtypes.split(",")
    # A setting is "<threads>" for the first dtype, "<threads> <dtype>" for the others.
    settings = [n if d == dtypes[0] else f"{n} {d}" for d in dtypes for n in thread_settings]
    if args.modules:  # "<setting> modules": the same with the decode steps on the modules
        settings = [s for n in settings for s in (n, f"{n} {MODULES}")]
    batches = [int(b) for b in args.batches.split(",")]
    if kernels() is None:
        raise SystemExit("the CPU kernels are off or did not build: nothing to scale")

    uptime_before = uptime()
    llms = {
        d: LLM(
            model=args.model,
            max_model_len=2048,
            enable_prefix_caching=False,
            max_num_seqs=max(batches),
            num_threads=int(thread_settings[0].removesuffix("t")),
            dtype=d,
        )
        for d in dtypes
    }
    fused = {d: llm.engine.runner.fused_decode for d, llm in llms.items()}
    encode = llms[dtypes[0]].get_tokenizer().encode
    prompts = {b: [encode(PROMPT.format(i=i)) for i in range(b)] for b in batches}
    for llm in llms.values():
        for b in batches:  # first use of each batch shape is not timed
            run(llm, prompts[b], 2)

    runs: dict[str, dict[int, list[dict]]] = {n: {b: [] for b in batches} for n in settings}
    reference: dict[tuple[str, int], list] = {}  # greedy tokens per dtype and batch
    identical = True
    for _ in range(args.repeats):
        for n in settings:
            threads, _, dtype = n.removesuffix(f" {MODULES}").partition(" ")
            set_threads(threads)
            llm = llms[dtype or dtypes[0]]
            runner = llm.engine.runner
            runner.fused_decode = None if n.endswith(MODULES) else fused[dtype or dtypes[0]]
            for b in batches:
                one, _, _ = run(llm, prompts[b], 1)
                wall, cpu, tokens = run(llm, prompts[b], args.tokens)
                identical &= reference.setdefault((dtype, b), tokens) == tokens
                runs[n][b].append(
                    {"one_s": one, "n_s": wall, "cpu_s": cpu, "loadavg_1m": os.getloadavg()[0]}
                )
    uptime_after = uptime()

    summary: dict[str, dict[int, dict[str, float]]] = {}
    for n in settings:
        summary[n] = {}
        for b in batches:
            rs = runs[n][b]
            summary[n][b] = {
                "tpot_s": statistics.median(
                    (r["n_s"] - r["one_s"]) / (args.tokens - 1) for r in rs
                ),
                "tok_s": statistics.median(b * args.tokens / r["n_s"] for r in rs),
                "cores": statistics.median(r["cpu_s"] / r["n_s"] for r in rs),
            }

    base = settings[0]
    print(f"CPU: {cpu_model()}; before: {uptime_before}")
    print(
        f"model={args.model} tokens={args.tokens} repeats={args.repeats} "
        f"medians, ratios to threads={base} (Nt: torch's pool at N threads too, else 1); "
        f"dtype {dtypes[0]} unless named; '{MODULES}': decode steps through the modules"
    )
    width = max(7, *(len(n) for n in settings))
    print(
        f"{'batch':>5} {'threads':>{width}} {'TPOT ms':>9} {'tok/s':>8} {'cores':>6} {'speedup':>8}"
    )
    for b in batches:
        for n in settings:
            row = summary[n][b]
            speedup = summary[base][b]["tpot_s"] / row["tpot_s"]
            print(
                f"{b:>5} {n:>{width}} {row['tpot_s'] * 1e3:>9.1f} {row['tok_s']:>8.1f} "
                f"{row['cores']:>6.2f} {speedup:>7.2f}x"
            )
    print("speedup = TPOT at the first setting / TPOT here")
    print(f"after: {uptime_after}")
    print(f"greedy tokens identical across thread settings (per dtype): {identical}")

    result = {
        "model": args.model,
        "cpu": cpu_model(),
        "uptime_before": uptime_before,
        "uptime_after": uptime_after,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "identical_tokens": identical,
        "summary": {n: {str(b): v for b, v in s.items()} for n, s in summary.items()},
        "runs": {n: {str(b): v for b, v in r.items()} for n, r in runs.items()},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    if not identical:
        raise SystemExit("greedy tokens differ between settings")


if __name__ == "__main__":
    main()
