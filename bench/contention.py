"""What a little CPU taken by other work costs the engine's batched decode step.

A served engine replica shares its host with the rest of the app (the HTTP proxy, the ingress,
Ray's controller and GCS) and, in the same process, with the replica's event loop. This runs
the offline engine (default model, fp32, greedy, ``ignore_eos``, ``--batch`` requests,
``--threads`` kernel threads) and times its decode step alone and beside a competitor that
wakes every few milliseconds and burns ``--share`` of one core in short bursts, the way the
serving processes use the CPU under a streaming load:

- ``process``: the competitor is another process (the proxy, the ingress, Ray);
- ``thread``: a Python thread of this process (the replica's event loop: it also takes the
  GIL that the engine thread needs between kernel calls).

Settings alternate on every repeat (alone, process, thread, alone, ...) so that background
load hits them alike; the script prints the median step of each and its ratio to the step
alone, next to ``1 + share / threads`` (the step if the competitor's CPU time came out of the
engine's threads' time and nothing else). The engine's tokens are checked to be the same in
every setting.

    python bench/contention.py [--share 0.15] [--threads 2] [--batch 16] [--tokens 48]
        [--repeats 5] [--json bench/results/contention.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import threading
import time
from pathlib import Path

from threads import PROMPT, cpu_model, uptime

from neuron_runtime import LLM, SamplingParams

BURST_S = 0.0005  # one burst of the competitor: about an SSE chunk's work in the serving path


def burn(share: float, stop: threading.Event) -> None:
    """Bursts of BURST_S of pure-Python work, ``share`` of the wall time, until ``stop``."""
    period = BURST_S / share
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < BURST_S:
            sum(range(100))
        time.sleep(max(0.0, period - BURST_S))


class Competitor:
    """The competing work of one setting, started and stopped around a timed run."""

    def __init__(self, kind: str, share: float) -> None:
        self.kind, self.share = kind, share
        self.stop: threading.Event | None = None
        self.runner: threading.Thread | multiprocessing.Process | None = None

    def __enter__(self) -> Competitor:
        if self.kind == "thread":
            self.stop = threading.Event()
            self.runner = threading.Thread(target=burn, args=(self.share, self.stop), daemon=True)
        elif self.kind == "process":
            # Forked: the child runs only ``burn`` (the kernel pool starts a fork with no
            # workers), with nothing to import first.
            context = multiprocessing.get_context("fork")
            self.stop = context.Event()  # type: ignore[assignment]
            self.runner = context.Process(target=burn, args=(self.share, self.stop))
        if self.runner is not None:
            self.runner.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stop is not None and self.runner is not None:
            self.stop.set()
            self.runner.join(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--share", type=float, default=0.15, help="of one core, 0-1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="bench/results/contention.json")
    args = parser.parse_args()
    if not 0 < args.share < 1:
        parser.error("--share must be in (0, 1)")

    llm = LLM(
        model="smollm2-135m-instruct",
        max_num_seqs=args.batch,
        num_threads=args.threads,
        enable_prefix_caching=False,
    )
    prompts = [PROMPT.format(i=i) for i in range(args.batch)]
    full = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, full)]  # warm-up too

    settings = ("alone", "process", "thread")
    steps: dict[str, list[float]] = {s: [] for s in settings}
    same_tokens = True
    for _ in range(args.repeats):
        for setting in settings:
            with Competitor(setting, args.share):
                start = time.perf_counter()
                llm.generate(prompts, first)
                one = time.perf_counter() - start
                start = time.perf_counter()
                outputs = llm.generate(prompts, full)
                whole = time.perf_counter() - start
            steps[setting].append((whole - one) / (args.tokens - 1) * 1e3)
            same_tokens &= [o.outputs[0].token_ids for o in outputs] == reference

    alone = statistics.median(steps["alone"])
    fair = 1 + args.share / args.threads
    print(
        f"{cpu_model()}; {uptime()}\nbatch {args.batch}, {args.threads} threads, competitor "
        f"{args.share:.2f} of a core in {BURST_S * 1e3:.1f} ms bursts; decode step (ms):"
    )
    print(f"{'setting':<8} {'median':>8} {'ratio':>6} {'fair':>6}  runs")
    report = {"cpu": cpu_model(), "args": vars(args), "same_tokens": same_tokens, "steps": steps}
    for setting in settings:
        median = statistics.median(steps[setting])
        ratio = median / alone
        report[f"{setting}_ratio"] = ratio
        runs = " ".join(f"{s:.1f}" for s in steps[setting])
        shown_fair = "" if setting == "alone" else f"{fair:.2f}"
        print(f"{setting:<8} {median:>8.1f} {ratio:>6.2f} {shown_fair:>6}  {runs}")
    print(f"same tokens in every setting: {same_tokens}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
