"""The CPU kernels' packed GEMM on a model's linear layers: fp32 panels, bf16 panels (where
the CPU has AVX512_BF16), the GGUF's Q4_1 / Q8_0 blocks (when the model is a GGUF), and
torch's ``F.linear`` (MKL).

Runs every Linear of the model's decoder stack (qkv, o, gate_up, down) once per row count and
thread count, every way in turn (A B C A B C ...), and prints the best of ``--repeats`` times,
GFLOP/s and the GB/s of weights read (packed bytes / time). The quantized column uses the
layers' own GGUF blocks (Q4_1 for SmolLM2); the ``q8_0`` column packs the same fp32 weights
as Q8_0 (the lm_head's format) to compare formats on the same shapes. The tied lm_head is
timed apart (``lm_head`` rows: fp32 panels vs its GGUF blocks). Weights are the model's real
ones; inputs are random.

    python bench/cpu_linear.py [--rows 1,8,16,32,128] [--threads 1,2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

sys.path.insert(0, str(Path(__file__).resolve().parent))

from threads import cpu_model, uptime  # noqa: E402

from neuron_runtime.backends.cpu_kernels import kernels  # noqa: E402
from neuron_runtime.backends.cpu_ops import CPUKernelOps  # noqa: E402
from neuron_runtime.engine_args import EngineArgs  # noqa: E402
from neuron_runtime.layers.linear import Linear  # noqa: E402
from neuron_runtime.loader import load_model  # noqa: E402
from neuron_runtime.models.registry import model_class  # noqa: E402


def best_times(fns: dict, repeats: int) -> dict[str, float]:
    """Best time of each function, run in turn ``repeats`` times (after one warm-up each)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", default="1,8,16,32,128")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-mkl", action="store_true", help="skip the F.linear column")
    parser.add_argument("--json", default="bench/results/cpu_linear.json")
    args = parser.parse_args()
    fused = kernels()
    if fused is None:
        raise SystemExit("the CPU kernels are off or did not build")
    load_before = uptime()
    try:  # a GGUF model: its blocks beside the fp32 panels
        engine_args = EngineArgs(model=args.model, max_model_len=256, quantization="gguf")
        cfg = engine_args.create_engine_config().model
    except ValueError:
        cfg = EngineArgs(model=args.model, max_model_len=256).create_engine_config().model
    model = load_model(model_class(cfg.architecture), cfg.hf_config, cfg.path)
    names = [n for n, m in model.named_modules() if isinstance(m, Linear)]
    layers = [model.get_submodule(n) for n in names]
    weights = [(m.weight.detach().clone(), m.bias) for m in layers]
    emb = model.lm_head_weight.detach().clone()
    packed = {"fp32": [fused.pack(w) for w, _ in weights]}
    q8 = GGMLQuantizationType.Q8_0
    packed["q8_0"] = [fused.pack_q8_0(quantize(w.numpy(), q8), *w.shape) for w, _ in weights]
    head = {"fp32": fused.pack(emb)}
    if fused.has_bf16:  # dtype "bfloat16": the same weights rounded to bf16
        packed["bf16"] = [fused.pack_bf16(w) for w, _ in weights]
        head["bf16"] = fused.pack_bf16(emb)
    if "quantization_config" in cfg.hf_config:
        CPUKernelOps(fused).attach(model)  # packs the GGUF blocks
        gguf = [getattr(m, "quantized", None) for m in layers]
        if all(g is not None for g in gguf):
            fmt = gguf[0].format
            packed[f"gguf {fmt}"] = gguf
        quantized_head = getattr(model.logits_head, "quantized", None)
        if quantized_head is not None:
            head[f"gguf {quantized_head[1].format}"] = quantized_head[1]
    nbytes = {
        k: sum((p.nbytes if hasattr(p, "nbytes") else p.numel() * p.element_size()) for p in v)
        for k, v in packed.items()
    }
    head_bytes = {
        k: (p.nbytes if hasattr(p, "nbytes") else p.numel() * p.element_size())
        for k, p in head.items()
    }
    params = sum(w.numel() for w, _ in weights)
    print(f"CPU {cpu_model()}; load {load_before}")
    print(
        f"{len(layers)} linear layers, {params / 1e6:.1f}M weights; packed MB: "
        + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in nbytes.items())
        + f"; lm_head {emb.shape[0]}x{emb.shape[1]}"
    )
    kinds = list(packed) + ([] if args.no_mkl else ["F.linear"])
    header = " ".join(f"{k + ' ms':>13} {'GFLOP/s':>8} {'GB/s':>6}" for k in kinds)
    print(f"{'threads':>7} {'rows':>5} {header}")
    results = []
    with torch.inference_mode():
        for threads in (int(t) for t in args.threads.split(",")):
            fused.set_num_threads(threads)
            torch.set_num_threads(threads)
            for rows in (int(r) for r in args.rows.split(",")):
                inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w, _ in weights}
                fns = {}
                for kind, ps in packed.items():

                    def run(ps=ps, inputs=inputs) -> None:
                        for (w, b), p in zip(weights, ps, strict=True):
                            fused.linear(inputs[w.shape[1]], p, b, w.shape[0])

                    fns[kind] = run
                if not args.no_mkl:

                    def mkl(inputs=inputs) -> None:
                        for w, b in weights:
                            F.linear(inputs[w.shape[1]], w, b)

                    fns["F.linear"] = mkl
                times = best_times(fns, args.repeats if rows <= 64 else max(1, args.repeats // 2))
                flops = 2 * rows * params
                cells = []
                for kind in kinds:
                    t = times[kind]
                    gbs = nbytes.get(kind, params * 4) / t / 1e9
                    cells.append(f"{t * 1e3:>13.2f} {flops / t / 1e9:>8.1f} {gbs:>6.1f}")
                    results.append(
                        dict(
                            threads=threads,
                            rows=rows,
                            kind=kind,
                            seconds=t,
                            gflops=flops / t / 1e9,
                            gbs=gbs,
                        )
                    )
                print(f"{threads:>7} {rows:>5} " + " ".join(cells))
            x = torch.randn(1, emb.shape[1])
            fns = {
                k: (lambda p=p, x=x: fused.linear(x, p, None, emb.shape[0]))
                for k, p in head.items()
            }
            times = best_times(fns, args.repeats)
            print(
                f"{threads:>7} lm_head rows 1: "
                + ", ".join(
                    f"{k} {t * 1e3:.2f} ms ({head_bytes[k] / t / 1e9:.1f} GB/s)"
                    for k, t in times.items()
                )
            )
            for k, t in times.items():
                results.append(
                    dict(
                        threads=threads,
                        rows=1,
                        kind=f"lm_head {k}",
                        seconds=t,
                        gbs=head_bytes[k] / t / 1e9,
                    )
                )
    print(f"load after: {uptime()}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "cpu": cpu_model(),
                "load": [load_before, uptime()],
                "model": args.model,
                "packed_bytes": nbytes,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
