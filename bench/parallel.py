"""Tensor parallelism on this host: TP=1 vs TP=2 step time, and the collectives' share.

Two engines on the same weights, one thread per rank: TP=1 (one process) and TP=2 (this
process as rank 0 plus one spawned rank, joined by gloo). Runs alternate (TP=1, TP=2, ...) so
background load hits both alike. For each batch size B the script times engine steps:

- prefill: the step that prefills B prompts of ~P tokens
- decode: the median step time once every request is decoding
- collectives: on rank 0, the time inside the TP group's collectives (all-reduce after each
  row-parallel layer, the embedding's all-reduce, the logits' all-gather, the step's broadcast
  of its inputs), as a share of the decode step; it includes waiting for the slower rank

Greedy tokens of both engines must agree; the script checks it.

    python bench/parallel.py [--model smollm2-135m-instruct] [--batches 1,8]
        [--tokens 32] [--prompt-tokens 128] [--repeats 3] [--json bench/results/parallel.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from threads import cpu_model, uptime

from neuron_runtime import LLM, SamplingParams

WORDS = "the lighthouse keeper climbed the stairs every evening and watched the sea".split()  # noqa: SIM905


class CollectiveTimer:
    """Wraps rank 0's TP group methods to add up the seconds spent in them."""

    NAMES = ("all_reduce", "all_gather", "broadcast_object")

    def __init__(self, tp: Any) -> None:
        self.seconds = 0.0
        self.calls = 0
        for name in self.NAMES:
            setattr(tp, name, self._timed(getattr(tp, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


def run_batch(
    llm: LLM, batch: int, prompt_tokens: int, tokens: int, timer: CollectiveTimer | None
) -> dict[str, Any]:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        words = [WORDS[(i + j) % len(WORDS)] for j in range(prompt_tokens)]
        engine.add_request(f"b{batch}-{i}-{time.monotonic_ns()}", " ".join(words), params)
    steps: list[tuple[float, float, int]] = []  # (seconds, collective seconds, calls)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        before = (timer.seconds, timer.calls) if timer else (0.0, 0)
        start = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        elapsed = time.perf_counter() - start
        if timer:
            steps.append((elapsed, timer.seconds - before[0], timer.calls - before[1]))
        else:
            steps.append((elapsed, 0.0, 0))
    decode = steps[2:-1] or steps[1:]  # once every prompt is in: whole-batch decode steps
    return {
        "prefill_s": steps[0][0],
        "decode_s": statistics.median(s for s, _, _ in decode),
        "collective_share": statistics.median(c / s for s, c, _ in decode),
        "collectives_per_step": statistics.median(n for _, _, n in decode),
        "tokens": [outputs[k] for k in sorted(outputs, key=lambda k: int(k.split("-")[1]))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench/results/parallel.json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(max_model_len=512, num_kv_blocks=512, num_threads=1, max_num_seqs=64)
    tp2 = LLM(args.model, tensor_parallel_size=2, **common)
    timer = CollectiveTimer(tp2.engine.runner.state.tp)
    tp1 = LLM(args.model, **common)
    rows = []
    try:
        for batch in batches:
            runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
            for _ in range(args.repeats):
                runs[1].append(run_batch(tp1, batch, args.prompt_tokens, args.tokens, None))
                runs[2].append(run_batch(tp2, batch, args.prompt_tokens, args.tokens, timer))
            same = all(a["tokens"] == b["tokens"] for a, b in zip(runs[1], runs[2], strict=True))

            def med(tp: int, key: str, runs: dict = runs) -> float:
                return statistics.median(r[key] for r in runs[tp])

            rows.append(
                {
                    "batch": batch,
                    "tp1_prefill_ms": 1e3 * med(1, "prefill_s"),
                    "tp2_prefill_ms": 1e3 * med(2, "prefill_s"),
                    "tp1_decode_ms": 1e3 * med(1, "decode_s"),
                    "tp2_decode_ms": 1e3 * med(2, "decode_s"),
                    "tp2_collective_share": med(2, "collective_share"),
                    "tp2_collectives_per_step": med(2, "collectives_per_step"),
                    "greedy_identical": same,
                }
            )
    finally:
        tp2.engine.runner.close()
    header = (
        f"{'batch':>5} {'prefill TP1':>11} {'TP2':>8} {'decode TP1':>10} {'TP2':>8} "
        f"{'TP2/TP1':>7} {'coll. share':>11} {'coll./step':>10} {'same':>5}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['batch']:>5} {r['tp1_prefill_ms']:>9.1f}ms {r['tp2_prefill_ms']:>6.1f}ms "
            f"{r['tp1_decode_ms']:>8.1f}ms {r['tp2_decode_ms']:>6.1f}ms "
            f"{r['tp2_decode_ms'] / r['tp1_decode_ms']:>7.2f} {r['tp2_collective_share']:>11.0%} "
            f"{r['tp2_collectives_per_step']:>10.0f} {str(r['greedy_identical']):>5}"
        )
    meta = {"cpu": cpu_model(), "uptime": uptime(), "model": args.model, "args": vars(args)}
    print(f"cpu: {meta['cpu']}; {meta['uptime']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
