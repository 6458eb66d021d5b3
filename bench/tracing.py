"""What request tracing costs: tracing off vs on (unsampled, sampled), side by side.

Two parts:

1. Hooks, in this process, no Ray: one disaggregated request's every tracing call, in the order
   the ingress, the PD router, the request routers and the prefill and decode replicas make
   them (root span, ingress spans, context injected into the request dataclasses, route
   decisions, engine stamps turned into spans, KV spans, one stream step per output token).
   The dataclasses that carry a trace context are pickled as by a Ray hop; the per-token
   outputs, identical in every mode, are not. Modes alternate (A B C D, then D C B A):
   ``off`` (tracing disabled), ``unsampled`` (on, sample_ratio 0), ``sampled`` (on, every
   request, the JSON-lines exporter writing in its batch thread), ``off-again`` (disabled:
   the off/off-again difference is the measurement's noise). Per request: median
   microseconds over the rounds.
2. ``--serve``: end to end over HTTP, the colocated app twice on one local cluster (same model
   and sizing), tracing off and on (sample_ratio 1, the JSON-lines file), requests alternated
   between the two apps one at a time: E2E latency and TTFT medians and the on/off ratio.

    python bench/tracing.py --rounds 40 --requests 20 --output-tokens 64
    python bench/tracing.py --serve --serve-requests 40 --output-tokens 32

Prints tables and writes bench/results/tracing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.request_trace import StreamTrace, request_attributes  # noqa: E402
from deployments.protocol import (  # noqa: E402
    GenerateRequest,
    KVTransferInfo,
    SeqDelta,
    StepOutput,
)
from neuron_runtime import tracing  # noqa: E402
from neuron_runtime.outputs import CompletionOutput, RequestOutput  # noqa: E402
from router.route_trace import RouteTrace  # noqa: E402

T = TypeVar("T")
# "off" twice (A/A): the difference between the two is the noise floor of the measurement.
MODES = ("off", "unsampled", "sampled", "off-again")


def configure(mode: str, path: str) -> None:
    tracing.configure(
        {
            "enabled": not mode.startswith("off"),
            "sample_ratio": 0.0 if mode == "unsampled" else 1.0,
            "file": path,
        },
        "bench",
    )


def hop(obj: T) -> T:
    """What a Ray Serve hop does to a request dataclass."""
    return cast(T, pickle.loads(pickle.dumps(obj)))


STEPS = [StepOutput([SeqDelta(0, [token])], 128) for token in range(4096)]
CHAT = SimpleNamespace(messages=[])  # what the ingress passes: a chat request


async def engine_outputs(num_outputs: int) -> AsyncIterator[RequestOutput]:
    """What an engine streams for one request (DELTA outputs, one token each)."""
    now = time.monotonic()
    metrics = {"arrival_time": now - 0.003, "first_scheduled_time": now - 0.002}
    for token in range(num_outputs):
        yield RequestOutput(
            "r", None, [], [CompletionOutput(0, "", [token])], False, 0, None, metrics
        )


async def one_request(index: int, output_tokens: int, routes: dict[str, RouteTrace]) -> None:
    """Every tracing hook one PD request passes through, in order."""
    with tracing.root_span("POST /v1/chat/completions", {}, {"url.path": "/v1/chat"}):
        with tracing.span("ingress.validate"):
            pass
        with tracing.span("ingress.chat_template") as span:
            tracing.set_attributes(span, {"neuron_serve.prompt_tokens": 128})
        sampling = {"max_tokens": output_tokens, "temperature": 0.0, "n": 1}
        request_attributes(CHAT, "model", f"chatcmpl-{index}", sampling)
        request = GenerateRequest(
            f"r{index}", list(range(128)), sampling, trace_context=tracing.inject()
        )
        request = hop(request)
        # PD router
        router = tracing.start_span("pd_router", request.trace_context)
        downstream = dataclasses.replace(request, trace_context=tracing.inject(router))
        async with tracing.ending(router):
            pending = SimpleNamespace(
                metadata=SimpleNamespace(internal_request_id=str(index)), created_at=time.time()
            )
            routes["prefill"].note(pending, downstream, {"neuron_serve.route.queue_lengths": [0]})
            routes["prefill"].routed(pending, "prefill-a", "prefix_match", match_share=1.0)
            downstream = hop(downstream)
            # prefill replica
            prefill = tracing.EngineTrace("prefill", downstream.trace_context)
            async for _ in prefill.follow(engine_outputs(1), end=False):
                pass
            transfer = KVTransferInfo("nixl", "export", 1 << 20, 0.001)
            prefill.kv("kv.export", transfer, time.perf_counter() - 0.001)
            prefill.end()
            first = hop(
                StepOutput([SeqDelta(0, [1])], 128, queue_time_s=0.001, kv_transfer=transfer)
            )
            # decode replica
            routes["decode"].note(pending, downstream, {"neuron_serve.route.kv_free_blocks": [90]})
            routes["decode"].routed(pending, "decode-a", "kv_capacity", kv_free_blocks=90)
            decode_request = hop(downstream)  # a DecodeRequest carries the same context
            decode = tracing.EngineTrace("decode", decode_request.trace_context)
            async for out in decode.follow(engine_outputs(output_tokens - 1)):
                if out.outputs[0].token_ids[0] == 0:
                    decode.kv("kv.transfer", transfer, time.perf_counter() - 0.001)
        # ingress: detokenize and stream (the decode replica's steps, not traced, are reused)
        stream = StreamTrace.start([first])
        try:
            stream.step(first)
            for step in STEPS[: output_tokens - 1]:
                stream.step(step)
        finally:
            stream.finish(output_tokens, ["length"])


async def requests(count: int, output_tokens: int, routes: dict[str, RouteTrace]) -> None:
    for i in range(count):
        await one_request(i, output_tokens, routes)


def hooks_part(args: argparse.Namespace) -> dict:
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "traces.jsonl")
        routes = {"prefill": RouteTrace("prefill"), "decode": RouteTrace("decode")}
        for round_index in range(args.rounds + 1):
            # A B C D, then D C B A: no mode always follows the same one.
            for mode in MODES if round_index % 2 else MODES[::-1]:
                configure(mode, path)
                start = time.perf_counter()
                asyncio.run(requests(args.requests, args.output_tokens, routes))
                elapsed = time.perf_counter() - start
                tracing.flush()
                if round_index:  # the first round warms up
                    results[mode].append(elapsed / args.requests * 1e6)
        tracing.shutdown()
        lines = len(Path(path).read_text().splitlines()) if os.path.exists(path) else 0
    rows = {mode: statistics.median(values) for mode, values in results.items()}
    print(
        f"\nPart 1: tracing hooks of one PD request ({args.output_tokens} output tokens), "
        f"median of {args.rounds} rounds x {args.requests} requests"
    )
    print(f"{'mode':<10} {'us/request':>11} {'vs off':>9}")
    for mode in MODES:
        print(f"{mode:<10} {rows[mode]:>11.1f} {rows[mode] - rows['off']:>+9.1f}")
    spans_per_request = lines / (args.requests * (args.rounds + 1))
    print(f"spans written per sampled request: {spans_per_request:.0f}")
    return {"us_per_request": rows, "spans_per_request": spans_per_request, "rounds": results}


async def serve_part(args: argparse.Namespace) -> dict:
    import httpx
    from local_cluster import start_local_serve, stop_local_serve
    from ray import serve

    from app.builder import BuildArgs, build_openai_app

    port = start_local_serve()
    base = f"http://127.0.0.1:{port}"
    tmp = tempfile.mkdtemp()
    trace_path = os.path.join(tmp, "traces.jsonl")
    small = {"ray_actor_options": {"num_cpus": 0.5}}
    try:
        for name, tracing_args in (
            ("off", {}),
            ("on", {"enabled": True, "sample_ratio": 1.0, "file": trace_path}),
        ):
            app = build_openai_app(
                BuildArgs(
                    max_model_len=1024,
                    embedding_model=None,
                    engine_args={"num_kv_blocks": 128},
                    tracing=tracing_args,
                ),
                llm_options=small,
                ingress_options={"ray_actor_options": {"num_cpus": 0.1}},
            )
            serve.run(app, name=name, route_prefix=f"/{name}")
        times: dict[str, dict[str, list[float]]] = {
            name: {"e2e": [], "ttft": []} for name in ("off", "on")
        }
        body = {
            "messages": [{"role": "user", "content": "Tell me about the Nile river."}],
            "max_tokens": args.output_tokens,
            "min_tokens": args.output_tokens,
            "temperature": 0.0,
            "stream": True,
        }
        async with httpx.AsyncClient(timeout=300) as client:
            for index in range(args.serve_requests + 2):
                for name in ("off", "on") if index % 2 else ("on", "off"):
                    start = time.perf_counter()
                    first = None
                    async with client.stream(
                        "POST", f"{base}/{name}/v1/chat/completions", json=body
                    ) as response:
                        assert response.status_code == 200, response.status_code
                        async for line in response.aiter_lines():
                            compact = line.replace(" ", "")
                            if first is None and _has_text(compact):
                                first = time.perf_counter()
                    end = time.perf_counter()
                    if index >= 2:  # two warm-up rounds
                        times[name]["e2e"].append(end - start)
                        times[name]["ttft"].append((first or end) - start)
        rows = {
            name: {key: statistics.median(values) for key, values in t.items()}
            for name, t in times.items()
        }
        print(f"\nPart 2: colocated app over HTTP, {args.serve_requests} requests per mode")
        print(f"{'mode':<5} {'E2E ms':>8} {'TTFT ms':>8}")
        for name, row in rows.items():
            print(f"{name:<5} {row['e2e'] * 1e3:>8.1f} {row['ttft'] * 1e3:>8.1f}")
        ratio = rows["on"]["e2e"] / rows["off"]["e2e"]
        print(f"E2E on/off: {ratio:.3f}")
        return {"medians": rows, "e2e_on_off": ratio, "samples": times}
    finally:
        for name in ("off", "on"):
            with contextlib.suppress(Exception):  # never deployed
                serve.delete(name)
        stop_local_serve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--serve", action="store_true", help="also part 2 (a local cluster)")
    parser.add_argument("--serve-requests", type=int, default=40)
    args = parser.parse_args()
    result: dict = {
        "command": " ".join(sys.argv),
        "cpu": _cpu_model(),
        "load_average": os.getloadavg(),
        "hooks": hooks_part(args),
    }
    if args.serve:
        result["serve"] = asyncio.run(serve_part(args))
    out = Path(__file__).resolve().parent / "results" / "tracing.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nCPU: {result['cpu']}; load average {result['load_average']}; wrote {out}")


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _has_text(compact_line: str) -> bool:
    return '"content":"' in compact_line and '"content":""' not in compact_line


if __name__ == "__main__":
    main()
