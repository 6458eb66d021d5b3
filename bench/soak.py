"""Soak: a bounded mixed load on the PD app; replicas' RSS and the object store sampled.

Deploys the shipped configs on a local cluster (127.0.0.1) through the config path, as
`serve run` would: serve_config.yaml (prefill/decode on SmolLM2, embeddings) at /pd and
configs/serve/epd.yaml (encode -> prefill -> decode on the tiny LLaVA) at /epd for images.
Then, for ``--minutes``, ``--concurrency`` clients send a mix of text chats, image chats
(a pool of distinct images, so both encoding and the encoder's cache are exercised),
embeddings, and streams the client abandons after a few events (aborts). Every
``--sample-s`` it records the RSS of every replica process and the object store's used bytes.

Reported: requests per kind (ok / error / aborted), and for each replica and the object store
the value after warm-up, at the end, and the least-squares slope after ``--warmup-minutes``
(MiB per minute), which a leak shows as a steady positive slope. Prints a table, writes JSON.

    flock /tmp/neuron-ray.lock .venv/bin/python bench/soak.py --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_cluster import start_local_serve, stop_local_serve  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"pd": ROOT / "serve_config.yaml", "epd": ROOT / "configs" / "serve" / "epd.yaml"}
QUESTIONS = [
    "What is the capital of France?",
    "Tell me about the Nile river.",
    "How many legs does a spider have?",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
    "Explain what a hash table is.",
]
# The mix: kind -> weight.
MIX = {"text": 4, "stream_abort": 1.5, "image": 2, "embedding": 2.5}
MIB = 1 << 20


def deploy(port: int) -> dict[str, dict[str, Any]]:
    """Both configs as written but for the port, names and prefixes; their args by app."""
    import yaml
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    apps = []
    for name, path in CONFIGS.items():
        config = yaml.safe_load(path.read_text())
        (app,) = config["applications"]
        apps.append({**app, "name": name, "route_prefix": f"/{name}"})
    schema = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": apps,
    }
    client = _get_global_client()
    client.deploy_apps(ServeDeploySchema.model_validate(schema))
    deadline = time.monotonic() + 900
    while True:
        details = client.get_serve_details()["applications"]
        statuses = {name: details.get(name, {}).get("status") for name in CONFIGS}
        if "DEPLOY_FAILED" in statuses.values():
            raise SystemExit(f"deploy failed: {details}")
        if all(s == "RUNNING" for s in statuses.values()):
            return {app["name"]: app["args"] for app in apps}
        if time.monotonic() > deadline:
            raise SystemExit(f"not running after 900 s: {statuses}")
        time.sleep(1)


def replica_pids() -> dict[str, int]:
    """``app/deployment#replica`` -> pid of every RUNNING replica."""
    from ray.serve.context import _get_global_client

    out = {}
    details = _get_global_client().get_serve_details()["applications"]
    for app, app_details in details.items():
        for deployment, d in app_details["deployments"].items():
            for r in d["replicas"]:
                if r["state"] == "RUNNING" and r.get("pid"):
                    out[f"{app}/{deployment}#{r['replica_id'][:6]}"] = r["pid"]
    return out


def object_store_used() -> int:
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    # This cluster's address: other local clusters may be running beside it.
    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    return int(get_memory_info_reply(state).store_stats.object_store_bytes_used)


def sample() -> dict[str, float]:
    import psutil

    values: dict[str, float] = {"object_store": object_store_used() / MIB}
    for name, pid in replica_pids().items():
        try:
            values[name] = psutil.Process(pid).memory_info().rss / MIB
        except psutil.NoSuchProcess:
            continue
    return values


def png_url(seed: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


class Load:
    """The clients: each picks a kind by MIX weight, sends it, records the outcome."""

    def __init__(self, base: str, args: dict[str, dict[str, Any]], images: int, seed: int):
        self.base = base
        self.pd_model = args["pd"].get("served_model_name") or args["pd"]["model"]
        self.epd_model = args["epd"].get("served_model_name") or args["epd"]["model"]
        self.embedding_model = args["pd"]["embedding_model"]
        self.images = [png_url(i) for i in range(images)]
        self.rng = random.Random(seed)
        self.counts: dict[str, dict[str, int]] = {k: {} for k in MIX}

    def note(self, kind: str, result: str) -> None:
        self.counts[kind][result] = self.counts[kind].get(result, 0) + 1

    async def client(self, http, stop_at: float) -> None:  # noqa: ANN001 - httpx.AsyncClient
        kinds, weights = list(MIX), list(MIX.values())
        while time.monotonic() < stop_at:
            kind = self.rng.choices(kinds, weights)[0]
            try:
                result = await getattr(self, kind)(http)
            except Exception as exc:  # noqa: BLE001 - counted, the soak goes on
                result = f"exception {type(exc).__name__}"
            self.note(kind, result)

    async def text(self, http) -> str:  # noqa: ANN001
        body = {
            "model": self.pd_model,
            "messages": [{"role": "user", "content": self.rng.choice(QUESTIONS)}],
            "max_tokens": self.rng.randint(8, 48),
            "temperature": 0.7,
        }
        response = await http.post(f"{self.base}/pd/v1/chat/completions", json=body)
        return "ok" if response.status_code == 200 else f"http {response.status_code}"

    async def stream_abort(self, http) -> str:  # noqa: ANN001
        body = {
            "model": self.pd_model,
            "prompt": self.rng.choice(QUESTIONS),
            "max_tokens": 256,
            "ignore_eos": True,
            "stream": True,
        }
        leave_after = self.rng.randint(1, 6)
        async with http.stream("POST", f"{self.base}/pd/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"http {response.status_code}"
            events = 0
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
                if events >= leave_after:
                    return "aborted"
        return "ok"

    async def image(self, http) -> str:  # noqa: ANN001
        content = [
            {"type": "image_url", "image_url": {"url": self.rng.choice(self.images)}},
            {"type": "text", "text": "Describe the picture."},
        ]
        body = {
            "model": self.epd_model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.rng.randint(4, 16),
        }
        response = await http.post(f"{self.base}/epd/v1/chat/completions", json=body)
        return "ok" if response.status_code == 200 else f"http {response.status_code}"

    async def embedding(self, http) -> str:  # noqa: ANN001
        texts = [f"{self.rng.choice(QUESTIONS)} #{self.rng.randint(0, 10**6)}" for _ in range(8)]
        body = {"model": self.embedding_model, "input": texts}
        response = await http.post(f"{self.base}/pd/v1/embeddings", json=body)
        return "ok" if response.status_code == 200 else f"http {response.status_code}"


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (minute, MiB) points, MiB per minute."""
    if len(points) < 3:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else None


async def soak(base: str, args: argparse.Namespace, app_args: dict) -> tuple[Load, list]:
    import httpx

    load = Load(base, app_args, args.images, args.seed)
    samples: list[tuple[float, dict[str, float]]] = []
    start = time.monotonic()
    stop_at = start + args.minutes * 60
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=args.request_timeout_s, limits=limits) as http:
        clients = [asyncio.create_task(load.client(http, stop_at)) for _ in range(args.concurrency)]
        while time.monotonic() < stop_at:
            values = await asyncio.to_thread(sample)
            minute = (time.monotonic() - start) / 60
            samples.append((minute, values))
            done = sum(sum(c.values()) for c in load.counts.values())
            print(
                f"[{minute:5.1f} min] requests {done:5d}  object store "
                f"{values['object_store']:.1f} MiB  replicas RSS "
                f"{sum(v for k, v in values.items() if k != 'object_store'):.0f} MiB",
                flush=True,
            )
            await asyncio.sleep(min(args.sample_s, max(0.0, stop_at - time.monotonic())))
        await asyncio.gather(*clients)
    await asyncio.sleep(2)  # aborted streams and caches settle
    samples.append(((time.monotonic() - start) / 60, await asyncio.to_thread(sample)))
    return load, samples


def summarize(samples: list, warmup_minutes: float) -> dict[str, dict[str, float | None]]:
    series: dict[str, list[tuple[float, float]]] = {}
    for minute, values in samples:
        for name, mib in values.items():
            series.setdefault(name, []).append((minute, mib))
    out = {}
    for name, points in sorted(series.items()):
        after = [p for p in points if p[0] >= warmup_minutes]
        out[name] = {
            "start_mib": points[0][1],
            "after_warmup_mib": after[0][1] if after else None,
            "end_mib": points[-1][1],
            "slope_mib_per_min": slope(after),
            "num_samples": len(after),
        }
    return out


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load")
    parser.add_argument("--warmup-minutes", type=float, default=2.0, help="left out of slopes")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--images", type=int, default=24, help="distinct images in the pool")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="bench/results/soak.json")
    args = parser.parse_args()
    if args.warmup_minutes >= args.minutes:
        parser.error("--warmup-minutes must be shorter than --minutes")

    uptime_start = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    port = start_local_serve()
    try:
        app_args = deploy(port)
        load, samples = asyncio.run(soak(f"http://127.0.0.1:{port}", args, app_args))
    finally:
        stop_local_serve()
    memory = summarize(samples, args.warmup_minutes)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"\nsoak: {args.minutes:g} min, {args.concurrency} clients, CPU {cpu_model()}")
    print(f"load average at the start: {uptime_start.split('load average:')[-1].strip()}")
    print(f"load average at the end: {uptime.split('load average:')[-1].strip()}")
    print("\nrequests:")
    for kind, counts in load.counts.items():
        print(f"  {kind:<13} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"\nmemory (MiB; slope after {args.warmup_minutes:g} min of warm-up):")
    print(f"  {'':<40} {'start':>8} {'warm':>8} {'end':>8} {'MiB/min':>9}")
    for name, m in memory.items():
        s = m["slope_mib_per_min"]
        warm = m["after_warmup_mib"]
        print(
            f"  {name:<40} {m['start_mib']:>8.1f} "
            f"{'-' if warm is None else f'{warm:.1f}':>8} {m['end_mib']:>8.1f} "
            f"{'-' if s is None else f'{s:+.2f}':>9}"
        )
    result = {
        "command": " ".join(sys.argv),
        "cpu": cpu_model(),
        "uptime_start": uptime_start,
        "uptime": uptime,
        "args": vars(args),
        "requests": load.counts,
        "memory": memory,
        "samples": samples,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.json}")
    os._exit(0)  # Ray's atexit hooks after shutdown add nothing but time


if __name__ == "__main__":
    main()
