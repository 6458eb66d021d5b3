"""Offline throughput: our engine vs transformers ``generate``, same weights, same threads.

Runs both in one process, alternating (ours, HF, ours, HF, ...) so background load hits both
alike, and reports medians and ratios:

- batch-1 TPOT: (time for N tokens - time for 1 token) / (N - 1), greedy, ignore_eos
- batch-32 throughput: 32 prompts x 128 output tokens, greedy, ignore_eos

    python bench/throughput.py [--threads 1] [--repeats 3] [--json bench/results/throughput.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.model_store import resolve_model

PROMPT = "Write a short story about a lighthouse keeper number {i} and the sea."


class Ours:
    name = "neuron_runtime"

    def __init__(self, model: str) -> None:
        self.llm = LLM(model=model, max_model_len=2048, enable_prefix_caching=False)
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return sum(len(o.outputs[0].token_ids) for o in outs)


class HF:
    name = "transformers"

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # fixed length, like ignore_eos

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = self.model.generate(
            ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
        )
        return (out.shape[1] - width) * len(prompts)


def timed(fn, *args) -> tuple[float, int]:
    start = time.perf_counter()
    n = fn(*args)
    return time.perf_counter() - start, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tpot-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--json", default="bench/results/throughput.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    ours = Ours(args.model)
    hf = HF(resolve_model(args.model))
    encode = ours.tokenizer.encode
    one = [encode(PROMPT.format(i=0))]
    batch = [encode(PROMPT.format(i=i)) for i in range(args.batch)]
    for engine in (ours, hf):  # warm-up
        engine.generate(one, 4)

    tpot: dict[str, list[float]] = {ours.name: [], hf.name: []}
    tput: dict[str, list[float]] = {ours.name: [], hf.name: []}
    for _ in range(args.repeats):
        for engine in (ours, hf):
            t1, _ = timed(engine.generate, one, 1)
            tn, _ = timed(engine.generate, one, args.tpot_tokens)
            tpot[engine.name].append((tn - t1) / (args.tpot_tokens - 1))
            tb, n = timed(engine.generate, batch, args.batch_tokens)
            tput[engine.name].append(n / tb)

    med = {k: statistics.median(v) for k, v in tpot.items()}
    thr = {k: statistics.median(v) for k, v in tput.items()}
    print(f"threads={args.threads} repeats={args.repeats} load={os.getloadavg()[0]:.2f}")
    print(f"{'engine':<16}{'b1 TPOT ms':>12}{'b1 tok/s':>10}{f'b{args.batch} tok/s':>12}")
    for name in (ours.name, hf.name):
        print(f"{name:<16}{med[name] * 1e3:>12.1f}{1 / med[name]:>10.1f}{thr[name]:>12.1f}")
    ratio_b1 = med[hf.name] / med[ours.name]
    ratio_bn = thr[ours.name] / thr[hf.name]
    print(
        f"ratio (ours / transformers): batch-1 speed {ratio_b1:.2f}x, "
        f"batch-{args.batch} throughput {ratio_bn:.2f}x"
    )

    result = {
        "model": args.model,
        "threads": args.threads,
        "repeats": args.repeats,
        "machine": platform.processor() or platform.machine(),
        "loadavg_1m": os.getloadavg()[0],
        "tpot_s": tpot,
        "batch_throughput_tok_s": tput,
        "batch": args.batch,
        "batch_tokens": args.batch_tokens,
        "ratio_batch1": ratio_b1,
        "ratio_batch": ratio_bn,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
