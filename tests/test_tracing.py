"""Request tracing (neuron_runtime/tracing.py, app/middleware.py, app/request_trace.py).

Unit tests read the JSON-lines file the exporter writes (or the OTLP protobuf a local HTTP
server receives) and check ids, parent links and timestamps against values fixed by the test:
the client's traceparent, the engine stamps handed in. The end-to-end test at the bottom sends
a chat request with a traceparent through the disaggregated app on the shared cluster and
checks the span tree that the ingress, the PD router and the prefill and decode replicas wrote.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest

from neuron_runtime import tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
def trace_file(tmp_path: Path):
    """Tracing on in this process, spans to a fresh JSON-lines file; off again afterwards."""
    path = tmp_path / "traces.jsonl"
    tracing.configure({"enabled": True, "file": str(path), "export_interval_s": 0.05}, "test")
    try:
        yield path
    finally:
        tracing.shutdown()


def read_spans(path: Path) -> list[dict]:
    tracing.flush()
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_name(spans: list[dict]) -> dict[str, dict]:
    return {s["name"]: s for s in spans}


# -- the tracer ------------------------------------------------------------------------------


def test_off_every_hook_is_a_noop(tmp_path):
    tracing.configure({"enabled": False, "file": str(tmp_path / "t.jsonl")}, "test")
    assert not tracing.enabled()
    with tracing.root_span("root", {"traceparent": TRACEPARENT}, {}) as root:
        assert root is None
        with tracing.span("child") as child:
            assert child is None
        assert tracing.start_span("x", {"traceparent": TRACEPARENT}) is None
        assert tracing.inject() is None
        tracing.engine_spans(None, "prefill", {"arrival_time": 0.0}, 1.0)
    assert not (tmp_path / "t.jsonl").exists()


def test_spans_continue_the_incoming_trace_across_a_serialized_hop(trace_file):
    with tracing.root_span("POST /v1/chat/completions", {"traceparent": TRACEPARENT}, {}) as root:
        assert root is not None
        with tracing.span("ingress.chat_template", attributes={"n": 3}):
            pass
        carrier = tracing.inject()
    # Another process: only the W3C headers travel (a request dataclass field).
    assert carrier is not None and carrier["traceparent"].startswith(f"00-{TRACE_ID}-")
    remote = tracing.start_span("prefill", json.loads(json.dumps(carrier)))
    assert remote is not None
    tracing.record_span("prefill.queue", remote, 1_000_000_000, 1_500_000_000)
    tracing.end(remote)

    spans = by_name(read_spans(trace_file))
    assert set(spans) == {
        "POST /v1/chat/completions",
        "ingress.chat_template",
        "prefill",
        "prefill.queue",
    }
    assert {s["trace_id"] for s in spans.values()} == {TRACE_ID}
    root_record = spans["POST /v1/chat/completions"]
    assert root_record["parent_span_id"] == PARENT_ID  # the client's span
    assert root_record["kind"] == "SERVER"
    assert spans["ingress.chat_template"]["parent_span_id"] == root_record["span_id"]
    assert spans["ingress.chat_template"]["attributes"] == {"n": 3}
    assert spans["prefill"]["parent_span_id"] == root_record["span_id"]
    assert spans["prefill.queue"]["parent_span_id"] == spans["prefill"]["span_id"]
    queue = spans["prefill.queue"]
    assert (queue["start_time_unix_nano"], queue["end_time_unix_nano"]) == (
        1_000_000_000,
        1_500_000_000,
    )


def test_an_untraced_request_records_nothing_even_under_a_current_span(trace_file):
    with tracing.root_span("root", {}, {}) as root:
        assert root is not None
        # A request that crossed a hop without trace context (parent None) is not traced.
        assert tracing.start_span("remote", None) is None
        assert tracing.inject(None) is None
        with tracing.span("child", None) as child:
            assert child is None
    assert [s["name"] for s in read_spans(trace_file)] == ["root"]


def test_sampling_ratio_and_the_incoming_sampled_flag(tmp_path):
    path = tmp_path / "traces.jsonl"
    tracing.configure({"enabled": True, "file": str(path), "sample_ratio": 0.0}, "test")
    try:
        with tracing.root_span("unsampled", {}, {}) as root:
            assert root is None
            assert tracing.inject() is None
            assert tracing.start_span("child") is None
        # The client decided: sampled (flags 01) wins over the ratio ...
        with tracing.root_span("client-sampled", {"traceparent": TRACEPARENT}, {}) as root:
            assert root is not None
        # ... and so does not sampled (flags 00).
        unsampled = TRACEPARENT[:-2] + "00"
        with tracing.root_span("client-unsampled", {"traceparent": unsampled}, {}) as root:
            assert root is None
        # A hop that carried an unsampled context records nothing either.
        assert tracing.start_span("remote", {"traceparent": unsampled}) is None
        assert [s["name"] for s in read_spans(path)] == ["client-sampled"]
    finally:
        tracing.shutdown()


def test_ratio_one_starts_a_new_trace_without_traceparent(trace_file):
    with tracing.root_span("root", {}, {}) as root:
        assert root is not None
    (record,) = read_spans(trace_file)
    assert record["parent_span_id"] is None and len(record["trace_id"]) == 32
    assert record["trace_id"] != TRACE_ID


def test_engine_stamps_become_queue_and_compute_spans(trace_file):
    now = time.monotonic()
    metrics = {"arrival_time": now - 3.0, "first_scheduled_time": now - 2.0}
    wall_now = time.time_ns()
    with tracing.root_span("root", {"traceparent": TRACEPARENT}, {}) as root:
        tracing.engine_spans(root, "decode", metrics, now - 0.5, {"neuron_serve.num_steps": 7})
    spans = by_name(read_spans(trace_file))
    queue, compute = spans["decode.queue"], spans["decode.compute"]
    # The monotonic stamps land where the wall clock was at those instants (within 50 ms).
    assert abs(queue["start_time_unix_nano"] - (wall_now - 3_000_000_000)) < 50_000_000
    assert queue["end_time_unix_nano"] - queue["start_time_unix_nano"] == pytest.approx(
        1e9, abs=1e6
    )
    assert compute["start_time_unix_nano"] == pytest.approx(queue["end_time_unix_nano"], abs=1e6)
    assert compute["end_time_unix_nano"] - compute["start_time_unix_nano"] == pytest.approx(
        1.5e9, abs=1e6
    )
    assert compute["attributes"] == {"neuron_serve.num_steps": 7}
    assert {queue["parent_span_id"], compute["parent_span_id"]} == {spans["root"]["span_id"]}


def test_an_exception_marks_the_span_as_an_error(trace_file):
    with tracing.root_span("root", {}, {}), pytest.raises(ValueError), tracing.span("failing"):
        raise ValueError("bad input")
    spans = by_name(read_spans(trace_file))
    assert spans["failing"]["status"]["code"] == "ERROR"
    assert spans["failing"]["events"][0]["name"] == "exception"


def test_config_is_validated():
    with pytest.raises(ValueError, match="sample_ratio"):
        tracing.TracingConfig(enabled=True, sample_ratio=1.5)
    with pytest.raises(ValueError, match="export_interval_s"):
        tracing.TracingConfig(export_interval_s=0)


def test_otlp_endpoint_from_config_or_the_standard_variables(monkeypatch):
    for name in tracing.OTLP_ENDPOINT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert tracing.TracingConfig().otlp_url() is None
    config = tracing.TracingConfig(otlp_endpoint="http://collector:4318/")
    assert config.otlp_url() == "http://collector:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert tracing.TracingConfig().otlp_url() == ""  # the exporter reads the variables


class _Collector(BaseHTTPRequestHandler):
    received: list[tuple[str, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("how", ["config", "env"])
def test_otlp_export_reaches_a_collector(how, monkeypatch, tmp_path):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    for name in tracing.OTLP_ENDPOINT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    _Collector.received = []
    server = HTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    config = {"enabled": True, "file": str(tmp_path / "unused.jsonl")}
    if how == "config":
        config["otlp_endpoint"] = endpoint
    else:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    tracing.configure(config, "test")
    try:
        with tracing.root_span("root", {"traceparent": TRACEPARENT}, {"k": "v"}):
            tracing.record_span("child", tracing.CURRENT, 10, 20)
        tracing.flush()
    finally:
        tracing.shutdown()
        server.shutdown()
    assert not (tmp_path / "unused.jsonl").exists()
    spans = []
    for path, body in _Collector.received:
        assert path == "/v1/traces"
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                spans.extend(scope_spans.spans)
    assert sorted(s.name for s in spans) == ["child", "root"]
    assert {s.trace_id.hex() for s in spans} == {TRACE_ID}


# -- the edge --------------------------------------------------------------------------------


def _edge_app():
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from app.middleware import EdgeMiddleware

    api = FastAPI()
    api.add_middleware(EdgeMiddleware, api_key=None, max_body_bytes=1 << 20)

    @api.post("/v1/echo")
    async def echo() -> StreamingResponse:
        async def body():
            with tracing.span("inside-stream"):
                yield b"a"
            yield b"b"

        with tracing.span("handler"):
            pass
        return StreamingResponse(body())

    @api.get("/health")
    async def health() -> dict:
        return {}

    return api


def test_middleware_root_span_honours_traceparent_and_covers_the_stream(trace_file):
    transport = httpx.ASGITransport(app=_edge_app())

    async def calls() -> None:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.post(
                "/v1/echo",
                headers={"traceparent": TRACEPARENT, "content-type": "application/json"},
                content=b"{}",
            )
            assert response.text == "ab"
            assert (await client.get("/health")).status_code == 200
            response = await client.post(
                "/v1/echo", headers={"content-type": "text/plain"}, content=b"{}"
            )
            assert response.status_code == 415

    import asyncio

    asyncio.run(calls())
    spans = read_spans(trace_file)
    roots = [s for s in spans if s["kind"] == "SERVER"]
    assert [r["attributes"]["http.response.status_code"] for r in roots] == [200, 415]
    traced, rejected = roots
    assert traced["trace_id"] == TRACE_ID and traced["parent_span_id"] == PARENT_ID
    assert traced["name"] == "POST /v1/echo"
    assert rejected["trace_id"] != TRACE_ID and rejected["parent_span_id"] is None
    children = by_name([s for s in spans if s["kind"] != "SERVER"])
    assert set(children) == {"handler", "inside-stream"}  # /health is not traced
    for child in children.values():
        assert child["parent_span_id"] == traced["span_id"]
        assert traced["start_time_unix_nano"] <= child["start_time_unix_nano"]
        assert child["end_time_unix_nano"] <= traced["end_time_unix_nano"]


def test_route_decision_span_names_the_replica_and_why(trace_file):
    from types import SimpleNamespace

    from router.route_trace import RouteTrace

    route = RouteTrace("prefill")
    with tracing.root_span("root", {}, {}):
        carrier = tracing.inject()
    request = SimpleNamespace(trace_context=carrier)
    pending = SimpleNamespace(metadata=SimpleNamespace(internal_request_id="r1"), created_at=100.0)
    untraced = SimpleNamespace(trace_context=None)
    other = SimpleNamespace(metadata=SimpleNamespace(internal_request_id="r2"), created_at=100.0)
    seen = {"neuron_serve.route.queue_lengths": [3, 0]}
    route.note(pending, request, seen)
    route.note(other, untraced, seen)
    route.routed(other, "b", "queue_length")  # not traced: nothing recorded
    route.routed(pending, "a", "prefix_match", match_share=0.75)
    route.routed(pending, "a", "prefix_match")  # once per routing
    spans = by_name(read_spans(trace_file))
    assert set(spans) == {"root", "route.prefill"}
    span = spans["route.prefill"]
    assert span["parent_span_id"] == spans["root"]["span_id"]
    assert span["start_time_unix_nano"] == 100 * 10**9
    assert span["attributes"] == {
        "neuron_serve.route.queue_lengths": [3, 0],
        "neuron_serve.route.replica": "a",
        "neuron_serve.route.reason": "prefix_match",
        "neuron_serve.route.match_share": 0.75,
    }


# -- end to end: the disaggregated app on the shared cluster ----------------------------------

# Who records what, by name: the span's parent and the process role that writes it.
PD_TREE = {
    "POST /traced/v1/chat/completions": (None, "ingress"),
    "ingress.validate": ("POST /traced/v1/chat/completions", "ingress"),
    "ingress.output_constraint": ("POST /traced/v1/chat/completions", "ingress"),
    "ingress.chat_template": ("POST /traced/v1/chat/completions", "ingress"),
    "ingress.detokenize_stream": ("POST /traced/v1/chat/completions", "ingress"),
    "pd_router": ("POST /traced/v1/chat/completions", "router"),
    "route.prefill": ("pd_router", "router"),
    "route.decode": ("pd_router", "router"),
    "prefill": ("pd_router", "prefill"),
    "prefill.queue": ("prefill", "prefill"),
    "prefill.compute": ("prefill", "prefill"),
    "kv.export": ("prefill", "prefill"),
    "decode": ("pd_router", "decode"),
    "kv.transfer": ("decode", "decode"),
    "decode.queue": ("decode", "decode"),
    "decode.compute": ("decode", "decode"),
}


def _traced_app(base: str, model: Path, path: Path, name: str, **disaggregation):  # noqa: ANN202
    """The disaggregated app over the tiny Llama (KV through NIXL) as ``name``, tracing every
    request to the JSON-lines file ``path``; (base URL, path) while deployed."""
    from ray import serve

    from app.builder import BuildArgs, build_openai_app

    small = {"ray_actor_options": {"num_cpus": 0.05}}
    app = build_openai_app(
        BuildArgs(
            mode="disaggregated",
            model=str(model),
            served_model_name="tiny",
            max_model_len=256,
            embedding_model=None,
            engine_args={"num_kv_blocks": 64},
            disaggregation=disaggregation,
            tracing={"enabled": True, "file": str(path), "export_interval_s": 0.2},
        ),
        prefill_options=small,
        decode_options=small,
        ingress_options=small,
    )
    serve.run(app, name=name, route_prefix=f"/{name}")
    try:
        yield base, path
    finally:
        serve.delete(name)


@pytest.fixture(scope="module")
def traced_pd(serve_cluster, tiny_llama_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "traces.jsonl"
    yield from _traced_app(serve_cluster, tiny_llama_path, path, "traced")


def wait_for_spans(path: Path, trace_id: str, names: set[str], timeout_s: float = 30.0) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        spans = []
        if path.exists():
            lines = path.read_text().splitlines()
            spans = [s for s in map(json.loads, lines) if s["trace_id"] == trace_id]
        if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


@pytest.mark.ray
def test_pd_request_is_one_trace_across_every_replica(traced_pd, tiny_llama_path):
    from neuron_runtime.tokenizer import Tokenizer

    base, path = traced_pd
    messages = [{"role": "user", "content": "Name three rivers in Africa."}]
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 6,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"traceparent": TRACEPARENT}
    usage = None
    with httpx.stream(
        "POST", f"{base}/traced/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None and usage["completion_tokens"] == 6

    spans = wait_for_spans(path, TRACE_ID, set(PD_TREE))
    named = by_name(spans)
    assert set(PD_TREE) <= set(named), f"missing {set(PD_TREE) - set(named)}"
    assert len(named) == len(spans), "one span per name for one request with n = 1"

    # One tree: every span's parent is in the trace, the root's is the client's span.
    ids = {s["span_id"]: s for s in spans}
    root = named["POST /traced/v1/chat/completions"]
    assert root["parent_span_id"] == PARENT_ID and root["kind"] == "SERVER"
    for span in spans:
        if span is not root:
            assert span["parent_span_id"] in ids, span["name"]
    for name, (parent, role) in PD_TREE.items():
        span = named[name]
        if parent is not None:
            assert ids[span["parent_span_id"]]["name"] == parent, name
        assert span["role"] == role, name
        # Nested in the root's time (one host, one clock; 5 ms for the stamp conversion).
        assert span["start_time_unix_nano"] >= root["start_time_unix_nano"] - 5_000_000, name
        assert span["end_time_unix_nano"] <= root["end_time_unix_nano"] + 5_000_000, name
        assert span["end_time_unix_nano"] >= span["start_time_unix_nano"], name
    # Four processes: ingress, router, prefill and decode replicas.
    assert len({(s["role"], s["process"]) for s in spans}) >= 4

    # Root attributes against independent values: the prompt tokenized here, the response's
    # usage, the latencies ordered.
    attributes = root["attributes"]
    prompt_ids = Tokenizer(tiny_llama_path).encode_chat(messages)
    assert attributes["gen_ai.usage.input_tokens"] == len(prompt_ids) == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == 6
    assert attributes["gen_ai.request.model"] == "tiny"
    assert attributes["gen_ai.request.max_tokens"] == 6
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["http.response.status_code"] == 200
    latency = {
        k.removeprefix("gen_ai.latency."): v for k, v in attributes.items() if "latency" in k
    }
    root_seconds = (root["end_time_unix_nano"] - root["start_time_unix_nano"]) / 1e9
    assert 0 <= latency["time_in_queue"] < latency["time_to_first_token"]
    assert 0 < latency["time_in_model_prefill"] < latency["time_to_first_token"]
    assert latency["time_to_first_token"] <= latency["e2e"] <= root_seconds
    assert 0 < latency["time_in_model_decode"] <= latency["e2e"] - latency["time_to_first_token"]

    # The prefill engine's stamps agree with what the root reports.
    prefill_compute = named["prefill.compute"]
    seconds = (
        prefill_compute["end_time_unix_nano"] - prefill_compute["start_time_unix_nano"]
    ) / 1e9
    assert seconds == pytest.approx(latency["time_in_model_prefill"], abs=0.005)
    # The KV handoff: the transport on both sides, the bytes exported.
    export, transfer = named["kv.export"]["attributes"], named["kv.transfer"]["attributes"]
    assert export["neuron_serve.kv.transport"] == transfer["neuron_serve.kv.transport"] == "nixl"
    # 2 layers x (K, V) x 2 KV heads x 16 dims x 4 bytes per token, whole 16-token blocks
    blocks = {-(-len(prompt_ids) // 16), -(-(len(prompt_ids) + 1) // 16)}
    assert export["neuron_serve.kv.num_bytes"] in {b * 16 * 512 for b in blocks}
    assert named["decode.compute"]["attributes"]["neuron_serve.num_tokens"] >= 5
    route = named["route.prefill"]["attributes"]
    assert route["neuron_serve.route.reason"] in ("prefix_match", "queue_length")
    assert route["neuron_serve.route.replica"] in route["neuron_serve.route.candidates"]


def post_chat(app_url: str, body: dict, trace_id: str, sampled: bool = True) -> httpx.Response:
    """A chat completion whose client span (``PARENT_ID`` in ``trace_id``) is or is not sampled."""
    flags = "01" if sampled else "00"
    headers = {"traceparent": f"00-{trace_id}-{PARENT_ID}-{flags}"}
    return httpx.post(f"{app_url}/v1/chat/completions", json=body, headers=headers, timeout=120)


@pytest.mark.ray
def test_pd_request_the_client_marked_unsampled_is_not_traced(traced_pd):
    base, path = traced_pd
    trace_id = "5" * 32
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    response = post_chat(f"{base}/traced", body, trace_id, sampled=False)
    assert response.status_code == 200
    # A traced request after it: once its spans are written, the unsampled one's would be too.
    traced_id = "6" * 32
    response = post_chat(f"{base}/traced", body, traced_id)
    assert response.status_code == 200
    assert wait_for_spans(path, traced_id, {"decode.compute", "prefill.compute"})
    time.sleep(0.5)
    assert wait_for_spans(path, trace_id, set(), timeout_s=0) == []


@pytest.fixture(scope="module")
def traced_direct(serve_cluster, tiny_llama_path, tmp_path_factory):
    """Short prompts sent from the ingress straight to the decode replica (direct_decode, as
    serve_config.yaml ships)."""
    path = tmp_path_factory.mktemp("traces") / "direct.jsonl"
    yield from _traced_app(
        serve_cluster,
        tiny_llama_path,
        path,
        "traceddirect",
        max_local_prefill_tokens=128,
        direct_decode=True,
    )


DIRECT_ROOT = "POST /traceddirect/v1/chat/completions"
DIRECT_TREE = {
    DIRECT_ROOT: (None, "ingress"),
    "ingress.validate": (DIRECT_ROOT, "ingress"),
    "ingress.chat_template": (DIRECT_ROOT, "ingress"),
    "ingress.detokenize_stream": (DIRECT_ROOT, "ingress"),
    # The ingress's handle on the decode deployment picks the replica (and records why).
    "route.decode": (DIRECT_ROOT, "ingress"),
    "decode": (DIRECT_ROOT, "decode"),
    "decode.queue": ("decode", "decode"),
    "decode.compute": ("decode", "decode"),
}


@pytest.mark.ray
def test_direct_decode_request_is_traced_from_ingress_to_decode(traced_direct):
    """A short chat the ingress sends straight to the decode replica: its routing and decode
    spans hang under the root, and neither the PD router nor a prefill replica appears."""
    base, path = traced_direct
    trace_id = "7" * 32
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    response = post_chat(f"{base}/traceddirect", body, trace_id)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4
    named = by_name(wait_for_spans(path, trace_id, set(DIRECT_TREE)))
    assert set(DIRECT_TREE) <= set(named), f"missing {set(DIRECT_TREE) - set(named)}"
    assert not {"pd_router", "prefill"} & set(named), sorted(named)
    ids = {span["span_id"]: span for span in named.values()}
    assert named[DIRECT_ROOT]["parent_span_id"] == PARENT_ID
    for name, (parent, role) in DIRECT_TREE.items():
        if parent is not None:
            assert ids[named[name]["parent_span_id"]]["name"] == parent, name
        assert named[name]["role"] == role, name


def test_colocated_replica_spans_from_the_engine_stamps(trace_file, tiny_llama_path):
    """An LLMServer outside Serve: its request span and the queue and compute spans built from
    the engine's stamps, against the timings the replica reports in its own StepOutputs."""
    import asyncio

    from deployments.llm_server import LLMServer
    from deployments.protocol import GenerateRequest

    engine_args = {
        "model": str(tiny_llama_path),
        "max_model_len": 128,
        "num_kv_blocks": 32,
        "num_threads": 1,
    }
    config = {"enabled": True, "file": str(trace_file), "export_interval_s": 0.05}
    server = LLMServer.func_or_class(engine_args, tracing_config=config)
    sampling = {"temperature": 0.0, "max_tokens": 5, "ignore_eos": True, "detokenize": False}

    async def run() -> list:
        with tracing.root_span("root", {"traceparent": TRACEPARENT}, {}):
            context = tracing.inject()
        request = GenerateRequest("r1", [5, 6, 7, 8, 9], sampling, trace_context=context)
        steps = [step async for step in server.generate(request)]
        untraced = GenerateRequest("r2", [5, 6, 7], sampling)
        steps += [step async for step in server.generate(untraced)]
        return steps

    try:
        steps = asyncio.run(run())
    finally:
        server.engine.shutdown()
    assert sum(len(s.token_ids) for step in steps for s in step.seqs) == 10
    spans = by_name(read_spans(trace_file))
    assert set(spans) == {"root", "engine", "engine.queue", "engine.compute"}  # r1 only
    engine, queue, compute = spans["engine"], spans["engine.queue"], spans["engine.compute"]
    assert engine["parent_span_id"] == spans["root"]["span_id"]
    assert {queue["parent_span_id"], compute["parent_span_id"]} == {engine["span_id"]}
    assert compute["attributes"] == {"neuron_serve.num_steps": 5, "neuron_serve.num_tokens": 5}
    first = steps[0]
    queue_s = (queue["end_time_unix_nano"] - queue["start_time_unix_nano"]) / 1e9
    assert queue_s == pytest.approx(first.queue_time_s, abs=0.002)
    assert first.prefill_time_s is not None and first.prefill_time_s > 0
    for child in (queue, compute):
        assert child["start_time_unix_nano"] >= engine["start_time_unix_nano"] - 2_000_000
        assert child["end_time_unix_nano"] <= engine["end_time_unix_nano"] + 2_000_000
