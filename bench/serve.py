"""Serving benchmark: the colocated and disaggregated apps and the engine in-process, side by side.

Metrics as vLLM's ``bench serve`` defines them, per request:
  TTFT  time to first token (first streamed chunk with text)
  TPOT  (E2EL - TTFT) / (output tokens - 1)
  ITL   gaps between streamed chunks
  E2EL  arrival to last token
plus request and output-token throughput and goodput (requests/s meeting every SLO given).

Arrivals are Poisson at ``--request-rate`` (requests/s) or, with rate inf, as fast as
``--concurrency`` allows. Prompts are random token ids of ``--input-len``, greedy, ignore_eos,
``--output-len`` tokens, so every path does identical work.

With ``--start-server`` one local cluster runs the applications of ``--configs``:
``colocated`` (one LLMServer), ``disaggregated`` (PDRouter -> PrefillServer -> DecodeServer,
the KV through Ray's object store) and ``disaggregated-nixl`` (the same, the decode replica
reading the prefill replica's blocks through NIXL), and each round loads them in turn
(A B C A B C ...), so background load hits all alike. For each disaggregated app the KV
handoff is read from its /metrics, per transport: the export (prefill side, inside TTFT) and
the import (decode side, before the second token). The
"direct" run drives an in-process AsyncEngine with the same prompts and schedule; its
difference to the colocated app is the cost of the Serve path (proxy -> ingress -> LLM replica
and back, SSE, detokenization).

    python bench/serve.py --start-server --num-requests 16 --concurrency 4 --rounds 2
    python bench/serve.py --start-server --configs colocated,disaggregated,disaggregated-nixl
    python bench/serve.py --base-url http://127.0.0.1:8000 ...   # against `make serve`

Only 127.0.0.1 / localhost targets are accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from local_cluster import start_local_serve, stop_local_serve

MODEL = "smollm2-135m-instruct"
# --configs names -> (BuildArgs.mode, DisaggregationArgs.kv_transport)
CONFIGS = {
    "colocated": ("colocated", "object_store"),
    "disaggregated": ("disaggregated", "object_store"),
    "disaggregated-nixl": ("disaggregated", "nixl"),
}


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


async def http_request(client, url: str, model: str, prompt: list[int], output_len: int):  # noqa: ANN001
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
    result = RequestResult(ok=False)
    last = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                await response.aread()
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
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


async def direct_request(engine, prompt: list[int], output_len: int):  # noqa: ANN001
    from neuron_runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    result = RequestResult(ok=False)
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
    }


def start_server(args: argparse.Namespace) -> dict[str, str]:
    """A local cluster bound to 127.0.0.1 running each config without embeddings; name -> URL."""
    from ray import serve

    from app.builder import BuildArgs, DisaggregationArgs, build_openai_app

    port = start_local_serve()
    small = {"ray_actor_options": {"num_cpus": 0.1}}
    urls = {}
    for name in args.configs.split(","):
        mode, transport = CONFIGS[name]
        build = BuildArgs(
            mode=mode,
            max_model_len=args.max_model_len,
            embedding_model=None,
            disaggregation=DisaggregationArgs(kv_transport=transport),
        )
        app = build_openai_app(
            build,
            llm_options=small,
            prefill_options=small,
            decode_options=small,
            ingress_options=small,
        )
        serve.run(app, name=name, route_prefix=f"/{name}")
        urls[name] = f"http://127.0.0.1:{port}/{name}"
    return urls


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


def print_table(rows: dict[str, dict]) -> None:
    names = list(rows)
    print(f"{'metric':<28}" + "".join(f"{n:>16}" for n in names))
    lines = [
        ("completed", lambda s: s["completed"]),
        ("failed", lambda s: s["failed"]),
        ("req/s", lambda s: s["request_throughput"]),
        ("output tok/s", lambda s: s["output_token_throughput"]),
        ("goodput req/s", lambda s: s["goodput"]),
    ]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for p in ("p50_ms", "p99_ms"):
            lines.append((f"{metric.upper()} {p}", lambda s, m=metric, p=p: s[m][p]))
    for label, get in lines:
        cells = []
        for n in names:
            value = get(rows[n])
            cells.append(f"{value:>16.2f}" if isinstance(value, float) else f"{value!s:>16}")
        print(f"{label:<28}" + "".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None, help="a running server (127.0.0.1 only)")
    parser.add_argument("--start-server", action="store_true")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-duration-s", type=float, default=300.0)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    parser.add_argument("--no-direct", action="store_true", help="skip the in-process engine")
    parser.add_argument(
        "--configs",
        default="colocated,disaggregated",
        help=f"with --start-server, comma-separated: {', '.join(CONFIGS)}",
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the configs")
    parser.add_argument("--json", default="bench/results/serve.json")
    args = parser.parse_args()

    if args.start_server == (args.base_url is not None):
        sys.exit("give exactly one of --base-url and --start-server")
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        sys.exit(f"unknown --configs {sorted(unknown)}: choose from {', '.join(CONFIGS)}")
    rng = random.Random(args.seed)
    # Ids from the ordinary vocabulary (no special tokens), one fixed set for both paths.
    prompts = [
        [rng.randrange(1000, 40000) for _ in range(args.input_len)]
        for _ in range(args.num_requests)
    ]
    slo = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}
    rows: dict[str, dict] = {}

    started = False
    try:
        if args.start_server:
            urls = start_server(args)
            started = True
        else:
            urls = {"serve": args.base_url.rstrip("/")}
        for url in urls.values():
            host = urlparse(url).hostname
            if host not in ("127.0.0.1", "localhost"):
                sys.exit(f"refusing to load {host}: only 127.0.0.1 is allowed")
        rows.update(
            asyncio.run(
                asyncio.wait_for(serve_rounds(urls, args, prompts, slo), args.max_duration_s)
            )
        )
    finally:
        if started:
            stop_local_serve()
    if not args.no_direct:
        rows["direct"] = asyncio.run(
            asyncio.wait_for(direct_phase(args, prompts, slo), args.max_duration_s)
        )
    print_table({k: v for k, v in rows.items() if "completed" in v})
    served = [k for k in rows if k != "direct"]
    pairs = [(a, "direct") for a in served if "direct" in rows]
    for name in ("disaggregated", "disaggregated-nixl"):
        if "colocated" in rows and name in rows:
            pairs.append((name, "colocated"))
    if "disaggregated" in rows and "disaggregated-nixl" in rows:
        pairs.append(("disaggregated-nixl", "disaggregated"))
    for a, b in pairs:
        delta = {
            f"{m}_p50_delta_ms": rows[a][m]["p50_ms"] - rows[b][m]["p50_ms"]
            for m in ("ttft", "tpot", "itl", "e2el")
            if rows[a][m]["p50_ms"] is not None and rows[b][m]["p50_ms"] is not None
        }
        rows[f"{a}_minus_{b}"] = delta
        print(f"{a} minus {b} (p50):", ", ".join(f"{k}={v:.2f}" for k, v in delta.items()))
    for name, row in rows.items():
        for transport, h in row.get("handoff", {}).items():
            print(
                f"KV handoff ({name}, {transport}):",
                ", ".join(f"{k}={v:.3f}" for k, v in h.items() if v is not None),
            )
    report = {
        "config": {k: (str(v) if v == float("inf") else v) for k, v in vars(args).items()},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_at_end": os.getloadavg(),
        },
        "results": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


async def serve_rounds(urls: dict[str, str], args: argparse.Namespace, prompts, slo) -> dict:  # noqa: ANN001
    """Loads each app in turn for ``args.rounds`` rounds; one summary per app."""
    import httpx

    results: dict[str, list[RequestResult]] = {name: [] for name in urls}
    durations = dict.fromkeys(urls, 0.0)
    scrapes: dict[str, list[str]] = {name: [] for name in urls}
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        for url in urls.values():
            await http_request(client, f"{url}/v1/completions", args.model, prompts[0], 2)
        for name, url in urls.items():
            scrapes[name].append((await client.get(f"{url}/metrics")).text)
        for _ in range(args.rounds):
            for name, url in urls.items():
                got, duration = await run_load(
                    lambda p, u=url: http_request(
                        client, f"{u}/v1/completions", args.model, p, args.output_len
                    ),
                    prompts,
                    args.request_rate,
                    args.concurrency,
                    args.seed,
                )
                results[name].extend(got)
                durations[name] += duration
        for name, url in urls.items():
            scrapes[name].append((await client.get(f"{url}/metrics")).text)
    rows = {name: summarize(results[name], durations[name], slo) for name in urls}
    for name, (before, after) in scrapes.items():
        if "neuron:kv_transfer_seconds_count" in after:
            rows[name]["handoff"] = handoff_figures(before, after, rows[name]["ttft"])
    return rows


async def direct_phase(args: argparse.Namespace, prompts, slo) -> dict:  # noqa: ANN001
    import torch

    from neuron_runtime import AsyncEngine, EngineArgs

    torch.set_num_threads(1)  # as in the LLM replica
    engine = AsyncEngine.from_engine_args(
        EngineArgs(model=args.model, max_model_len=args.max_model_len, num_threads=1)
    )
    try:
        await direct_request(engine, prompts[0], 2)  # warm-up
        results, duration = await run_load(
            lambda p: direct_request(engine, p, args.output_len),
            prompts,
            args.request_rate,
            args.concurrency,
            args.seed,
        )
    finally:
        engine.shutdown()
    return summarize(results, duration, slo)


if __name__ == "__main__":
    main()
