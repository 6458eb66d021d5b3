"""The CPU kernels' packed GEMM against torch's ``F.linear`` (MKL) on a model's linear layers.

Runs every Linear of the model's decoder stack (qkv, o, gate_up, down; the lm_head apart)
once per row count, both ways, alternating, and prints the best of ``--repeats`` times,
GFLOP/s and the ratio. Weights are the model's real ones; inputs are random.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from neuron_runtime.backends.cpu_kernels import kernels
from neuron_runtime.layers.linear import Linear
from neuron_runtime.loader import load_hf_config, load_model
from neuron_runtime.model_store import resolve_model
from neuron_runtime.models.registry import model_class


def best_time(fn, repeats: int) -> float:
    fn()  # warm up: caches, first-touch of outputs
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", default="1,4,8,16,32,64,256,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fused = kernels()
    if fused is None:
        raise SystemExit("the CPU kernels are off or did not build")
    fused.set_num_threads(args.threads)
    path = resolve_model(args.model)
    cfg = load_hf_config(path)
    model = load_model(model_class(cfg["architectures"][0]), cfg, path)
    layers = [
        m for name, m in model.named_modules() if isinstance(m, Linear) and "lm_head" not in name
    ]
    weights = [(m.weight.detach(), m.bias) for m in layers]
    packed = [fused.pack(w) for w, _ in weights]
    params = sum(w.numel() for w, _ in weights)
    print(f"{len(layers)} linear layers, {params / 1e6:.1f}M weights, {args.threads} thread(s)")
    print(
        f"{'rows':>6} {'kernel ms':>10} {'GFLOP/s':>8} {'F.linear ms':>12} {'GFLOP/s':>8}"
        f" {'ratio':>6}"
    )
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w, _ in weights}

            def ours(inputs=inputs) -> None:
                for (w, b), p in zip(weights, packed, strict=True):
                    fused.linear(inputs[w.shape[1]], p, b, w.shape[0])

            def mkl(inputs=inputs) -> None:
                for w, b in weights:
                    F.linear(inputs[w.shape[1]], w, b)

            repeats = args.repeats if rows <= 64 else 1
            t_ours, t_mkl = best_time(ours, repeats), best_time(mkl, repeats)
            flops = 2 * rows * params
            print(
                f"{rows:>6} {t_ours * 1e3:>10.1f} {flops / t_ours / 1e9:>8.1f} "
                f"{t_mkl * 1e3:>12.1f} {flops / t_mkl / 1e9:>8.1f} {t_mkl / t_ours:>5.2f}x"
            )


if __name__ == "__main__":
    main()
