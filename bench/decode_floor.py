"""The memory floor of a batch-1 decode step, beside the engine's measured step.

At batch 1 every decode step reads every weight once (the tied embedding once more as the LM
head; one embedding row otherwise), so no engine on this box can step faster than
``weight bytes / read bandwidth``. This script measures that bandwidth with plain streaming
reads (``torch.sum`` over a buffer several times the size of the weights, so no cache holds
it; 1 and 2 threads, best of ``--repeats``), computes the floor for the model, runs the
offline engine's batch-1 decode at 1 and 2 kernel threads (TPOT = (time for N tokens - time for
1 token) / (N - 1)), and prints how far the engine is from the floor. For a GGUF model both
weight paths run, alternating (A B A B): ``fp32`` (``quantization="none"``, the dequantized
checkpoint) and ``gguf`` (the CPU kernels on the file's Q4_1 / Q8_0 blocks), each with its
own floor. Given a peer's TPOT
(``--peer-tpot-ms``) and a target speed-up over it (``--target-ratio``), it says whether the
target TPOT lies below the floor, that is out of reach for any software on this box and dtype.

    python bench/decode_floor.py [--model smollm2-135m-instruct] [--tokens 64] [--repeats 5]
        [--peer-tpot-ms 25.3 --target-ratio 1.6] [--json bench/results/decode_floor.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from threads import cpu_model, set_threads, uptime  # noqa: E402

from neuron_runtime import LLM, SamplingParams  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper and the sea."


def read_bandwidth(nbytes: int, threads: int, repeats: int) -> float:
    """Best streaming read rate in bytes/s over a float32 buffer of ``nbytes``."""
    torch.set_num_threads(threads)
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()  # touch every page once
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(1)
    return nbytes / best


def weight_bytes_per_step(llm: LLM) -> int:
    """Bytes of weights one batch-1 decode step reads: every parameter and packed weight
    buffer once (the CPU backend packs the linears' weights into buffers and empties the
    parameters; a tied LM head reads the embedding), the rotary tables left out. Layers on
    GGUF blocks count their packed blocks; a logits head on them reads those, and the
    embedding then only one row."""
    model = llm.engine.runner.model
    head = getattr(model.logits_head, "quantized", None)
    skip = {head[0].data_ptr()} if head is not None else set()
    tensors = [*model.parameters()]
    tensors += [b for name, b in model.named_buffers() if name.split(".")[-1] not in ("cos", "sin")]
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor.numel() == 0 or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        if tensor.data_ptr() in skip:
            total += tensor.shape[-1] * tensor.element_size()  # one embedding row
        else:
            total += tensor.numel() * tensor.element_size()
    for module in model.modules():
        panels = getattr(module, "quantized", None)
        if panels is not None:
            total += (panels[1] if isinstance(panels, tuple) else panels).nbytes
    return total


def decode_tpot(llm: LLM, tokens: int, repeats: int) -> float:
    prompt = llm.get_tokenizer().encode(PROMPT)

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params)
        return time.perf_counter() - start

    run(4)  # warm up
    samples = [(run(tokens) - run(1)) / (tokens - 1) for _ in range(repeats)]
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peer-tpot-ms", type=float, default=None)
    parser.add_argument("--target-ratio", type=float, default=1.6)
    parser.add_argument("--json", default="bench/results/decode_floor.json")
    args = parser.parse_args()

    load_before = uptime()
    llms = {
        "fp32": LLM(
            model=args.model,
            max_model_len=2048,
            enable_prefix_caching=False,
            num_threads=1,
            quantization="none",
        )
    }
    try:
        gguf = LLM(
            model=args.model,
            max_model_len=2048,
            enable_prefix_caching=False,
            num_threads=1,
            quantization="gguf",
        )
    except ValueError:
        pass  # not a GGUF model: one path only
    else:
        if getattr(gguf.engine.runner.model.logits_head, "quantized", None) is not None:
            llms["gguf"] = gguf
        else:
            del gguf  # no CPU kernels: one path only
    weights = {path: weight_bytes_per_step(llm) for path, llm in llms.items()}
    bandwidth = {t: read_bandwidth(4 * weights["fp32"], t, args.repeats) for t in (1, 2)}
    tpot: dict[str, dict[int, float]] = {path: {} for path in llms}
    for threads in (1, 2):
        set_threads(str(threads))
        samples: dict[str, list[float]] = {path: [] for path in llms}
        for _ in range(args.repeats):  # the paths in turn
            for path, llm in llms.items():
                samples[path].append(decode_tpot(llm, args.tokens, 1))
        for path in llms:
            tpot[path][threads] = statistics.median(samples[path])
    best_bw = max(bandwidth.values())
    floor_s = {path: w / best_bw for path, w in weights.items()}

    print(f"CPU {cpu_model()}; {load_before} -> {uptime()}")
    print(
        f"model {args.model}: "
        + ", ".join(
            f"{path} {w / 1e6:.1f} MB of weights read per step" for path, w in weights.items()
        )
        + "\n"
    )
    print(
        "| weights | threads | read bandwidth | engine batch-1 TPOT | floor (weights / best bw) |"
    )
    print("|---|---|---|---|---|")
    for path in llms:
        for t in (1, 2):
            print(
                f"| {path} | {t} | {bandwidth[t] / 1e9:.1f} GB/s | {tpot[path][t] * 1e3:.2f} ms | "
                f"{floor_s[path] * 1e3:.2f} ms ({tpot[path][t] / floor_s[path]:.2f}x the floor) |"
            )
    result = {
        "cpu": cpu_model(),
        "load": [load_before, uptime()],
        "model": args.model,
        "weight_bytes": weights,
        "read_bandwidth_bytes_s": bandwidth,
        "tpot_s": tpot,
        "floor_s": floor_s,
    }
    if args.peer_tpot_ms is not None:
        target_ms = args.peer_tpot_ms / args.target_ratio
        best_floor = min(floor_s.values())
        reachable = target_ms >= best_floor * 1e3
        print(
            f"\ntarget: peer TPOT {args.peer_tpot_ms:.1f} ms / {args.target_ratio} = "
            f"{target_ms:.2f} ms; lowest floor {best_floor * 1e3:.2f} ms: "
            + ("above the floor (reachable in principle)" if reachable else "below the floor")
        )
        result.update(target_tpot_ms=target_ms, target_reachable=reachable)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
