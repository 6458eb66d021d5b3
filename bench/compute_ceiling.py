"""The compute ceiling of the served load, beside the box's measured fp32 FMA peak.

``bench/serve.py``'s concurrency-16 load is ``--requests`` requests of ``--input-len`` prompt
and ``--output-len`` output tokens. Every token position goes through the decoder's linear
layers (2 flops per weight) and every output token through the logits head once, so the load
costs a fixed number of flops whatever the engine (attention, a few percent here, is left
out: the ceiling is generous). No engine can serve it faster than ``flops / peak``, where the
peak is what the cores' FMA units do with every operand in registers: a loop of independent
``vfmadd`` on the widest vectors this CPU has (compiled here with ``-march=native``), run on 1
and 2 threads at once, best of ``--repeats``.

Where the CPU has AVX512_BF16 it also measures the bf16 dot-product peak (a loop of
independent ``VDPBF16PS``), what ``dtype="bfloat16"`` runs the linear layers on.

Given a peer's output tok/s (``--peer-tok-s``) and a target speed-up over it
(``--target-ratio``), it prints the GFLOP/s the target needs against those peaks: a target
above a peak is out of reach for any software at that dtype on these cores.

    python bench/compute_ceiling.py [--model smollm2-135m-instruct] [--requests 32]
        [--input-len 40] [--output-len 64] [--peer-tok-s 300 --target-ratio 2]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from threads import cpu_model, uptime  # noqa: E402

from neuron_runtime.model_store import resolve_model  # noqa: E402

# 12 independent accumulators (two FMA pipes, four cycles of latency, and some slack), each a
# vector of the widest width the compiler targets; `iters` rounds of one FMA on each.
FMA_LOOP = r"""
typedef float v __attribute__((vector_size(VBYTES)));
#define EACH(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
long fma_loop(long iters, float seed) {
    v a, b;
    for (int l = 0; l < VBYTES / 4; l++) { a[l] = seed; b[l] = 1.0f - seed; }
#define INIT(k) v s##k = a * (float)k;
    EACH(INIT)
    for (long i = 0; i < iters; i++) {
#define STEP(k) s##k = s##k * a + b;
        EACH(STEP)
    }
    v t = {0};
#define SUM(k) t += s##k;
    EACH(SUM)
    float s = 0;
    for (int l = 0; l < VBYTES / 4; l++) s += t[l];
    return (long)s;
}
"""


# The same on bf16 pairs where the CPU has AVX512_BF16: each VDPBF16PS is 16 lanes x 2
# products x 2 flops, what dtype "bfloat16" runs its linear layers on.
BF16_LOOP = r"""
#include <immintrin.h>
#define EACH(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
long fma_loop(long iters, float seed) {
    const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f7f3f7f);
    const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f80);
#define INIT(k) __m512 s##k = _mm512_set1_ps(seed * k);
    EACH(INIT)
    for (long i = 0; i < iters; i++) {
#define STEP(k) s##k = _mm512_dpbf16_ps(s##k, a, b);
        EACH(STEP)
    }
    __m512 t = _mm512_setzero_ps();
#define SUM(k) t = _mm512_add_ps(t, s##k);
    EACH(SUM)
    return (long)_mm512_reduce_add_ps(t);
}
"""
BF16_FLOPS_PER_LANE = 4  # two products and two adds per 32-bit lane


def has_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return " avx512_bf16" in flags


def vector_bytes() -> int:
    """The widest float vector -march=native gives this CPU (64 with AVX-512)."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return 64 if " avx512f" in flags else 32 if " avx" in flags else 16


def build_fma_loop(width: int, source: str = FMA_LOOP) -> ctypes.CDLL:
    """The loop on ``width``-byte vectors, compiled in a directory removed once it is loaded."""
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory(prefix="fma-peak-") as tmp:
        src, lib = Path(tmp) / "fma.c", Path(tmp) / "fma.so"
        src.write_text(source.replace("VBYTES", str(width)))
        subprocess.run(
            [
                cc,
                "-O2",
                "-march=native",
                "-ffp-contract=fast",
                "-shared",
                "-fPIC",
                str(src),
                "-o",
                str(lib),
            ],
            check=True,
        )
        dll = ctypes.CDLL(str(lib))
    dll.fma_loop.argtypes = [ctypes.c_long, ctypes.c_float]
    dll.fma_loop.restype = ctypes.c_long
    return dll


def fma_peak(
    dll: ctypes.CDLL,
    width: int,
    threads: int,
    repeats: int,
    iters: int = 20_000_000,
    flops_per_lane: int = 2,
) -> float:
    """Best flop/s of ``threads`` threads running the loop at once (ctypes drops the GIL)."""
    flops_per_call = iters * 12 * (width // 4) * flops_per_lane
    best = 0.0
    for _ in range(repeats):
        workers = [
            threading.Thread(target=dll.fma_loop, args=(iters, 0.999)) for _ in range(threads)
        ]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, threads * flops_per_call / (time.perf_counter() - start))
    return best


def load_flops(model: str, requests: int, input_len: int, output_len: int) -> dict[str, float]:
    """Linear-layer flops of the load: decoder layers on every position, logits on outputs."""
    config = json.loads((resolve_model(model) / "config.json").read_text())
    h, inter = config["hidden_size"], config["intermediate_size"]
    layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    per_layer = h * heads * head_dim * 2 + 2 * h * kv + 3 * h * inter  # q, o; k, v; MLP
    decoder = 2 * layers * per_layer
    logits = 2 * h * config["vocab_size"]
    positions = requests * (input_len + output_len - 1)
    outputs = requests * output_len
    return {
        "decoder_flops_per_position": decoder,
        "logits_flops_per_token": logits,
        "total_flops": positions * decoder + outputs * logits,
        "output_tokens": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=40)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peer-tok-s", type=float, default=None)
    parser.add_argument("--target-ratio", type=float, default=2.0)
    parser.add_argument("--json", default="bench/results/compute_ceiling.json")
    args = parser.parse_args()

    load_before = uptime()
    width = vector_bytes()
    dll = build_fma_loop(width)
    peak = {t: fma_peak(dll, width, t, args.repeats) for t in (1, 2)}
    flops = load_flops(args.model, args.requests, args.input_len, args.output_len)
    per_token = flops["total_flops"] / flops["output_tokens"]
    ceiling = {t: p / per_token for t, p in peak.items()}

    print(f"CPU {cpu_model()}; {load_before} -> {uptime()}")
    print(
        f"load: {args.requests} requests x ({args.input_len} prompt + {args.output_len} output "
        f"tokens) of {args.model}: {flops['total_flops'] / 1e9:.0f} GFLOP in linear layers, "
        f"{per_token / 1e6:.0f} MFLOP per output token\n"
    )
    bf16_peak = {}
    if has_bf16():
        bf16 = build_fma_loop(64, BF16_LOOP)
        bf16_peak = {
            t: fma_peak(bf16, 64, t, args.repeats, flops_per_lane=BF16_FLOPS_PER_LANE)
            for t in (1, 2)
        }
    print("| threads | peak | output tok/s at that peak (ceiling) |")
    print("|---|---|---|")
    for t in (1, 2):
        print(f"| {t} | fp32 FMA {peak[t] / 1e9:.0f} GFLOP/s | {ceiling[t]:.0f} |")
    for t, p in bf16_peak.items():
        print(f"| {t} | bf16 VDPBF16PS {p / 1e9:.0f} GFLOP/s | {p / per_token:.0f} |")
    result = {
        "cpu": cpu_model(),
        "load": [load_before, uptime()],
        "model": args.model,
        "vector_bytes": width,
        "fma_peak_flops": peak,
        "bf16_peak_flops": bf16_peak,
        **flops,
        "ceiling_tok_s": ceiling,
    }
    if args.peer_tok_s is not None:
        target = args.peer_tok_s * args.target_ratio
        needed = target * per_token
        best = max(peak.values())
        print(
            f"\ntarget: {args.target_ratio} x peer's {args.peer_tok_s:.1f} tok/s = {target:.0f} "
            f"tok/s needs {needed / 1e9:.0f} GFLOP/s, {needed / best:.2f}x the FMA peak: "
            + ("within the peak" if needed <= best else "beyond the peak (out of reach)")
        )
        result.update(target_tok_s=target, needed_flops=needed, share_of_peak=needed / best)
        if bf16_peak:
            best_bf16 = max(bf16_peak.values())
            print(
                f"in bf16 (dtype bfloat16's linear layers): {needed / best_bf16:.2f}x the "
                "VDPBF16PS peak: "
                + ("within the peak" if needed <= best_bf16 else "beyond the peak (out of reach)")
            )
            result.update(share_of_bf16_peak=needed / best_bf16)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
