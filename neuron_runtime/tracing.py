"""Request tracing with OpenTelemetry: one trace per request across every process it visits.

Each process (the ingress, the PD router, every engine replica) calls ``configure`` once with
the application's ``TracingConfig``; it gets its own tracer provider (never the global one,
which Ray Serve's own tracing may hold) and exporter:

- OTLP over HTTP/protobuf when ``otlp_endpoint`` or the standard ``OTEL_EXPORTER_OTLP_ENDPOINT``
  / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` variables are set (the exporter also reads the other
  ``OTEL_EXPORTER_OTLP_*`` variables: headers, timeout, compression, certificates);
- otherwise one JSON-lines file, one span per line, that every process on a host appends to.

Only the ingress starts traces (``root_span``), sampled there with ``sample_ratio`` unless the
client's W3C ``traceparent`` says whether it is sampled. Every other span needs a recording
parent: the current span (``CURRENT``, the default), a span passed in, or the W3C headers a
request carried across a Ray hop (``inject`` -> a request dataclass -> ``parent=``). Without one
(``None``: an untraced request) a call does nothing, so an unsampled request or a process with
tracing off pays one ``is None`` test per hook.

Engine phases are not traced step by step: the engine stamps each request (arrival, first
scheduled, first token; ``RequestOutput.metrics``, monotonic seconds) and ``engine_spans``
turns those stamps into queue and compute spans once the request leaves the engine.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
DEFAULT_TRACE_FILE = "/tmp/neuron-serve/traces.jsonl"


class _Current:
    def __repr__(self) -> str:
        return "CURRENT"


# The current span as the parent (the default); None as a parent means: not traced.
CURRENT = _Current()
# A parent: a span, the W3C headers a request carried, CURRENT, or None (no-op).
Parent = Span | Mapping[str, str] | _Current | None
Attributes = Mapping[str, Any]


@dataclass(frozen=True)
class TracingConfig:
    """How a process traces. ``enabled`` False: every hook is a no-op."""

    enabled: bool = False
    # Share of new traces recorded (an incoming traceparent's sampled flag overrides it).
    sample_ratio: float = 1.0
    # OTLP/HTTP collector, e.g. http://collector:4318 (/v1/traces is appended when missing).
    otlp_endpoint: str | None = None
    # JSON-lines file used when no OTLP endpoint is configured.
    file: str = DEFAULT_TRACE_FILE
    service_name: str = "neuron-serve"
    # How often the batch processor exports (spans are written off the request path).
    export_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"tracing.sample_ratio must be in [0, 1], got {self.sample_ratio}")
        if not self.file:
            raise ValueError("tracing.file must name a file")
        if self.export_interval_s <= 0:
            raise ValueError(f"tracing.export_interval_s must be > 0, got {self.export_interval_s}")

    def otlp_url(self) -> str | None:
        """The collector URL spans go to, or None for the JSON-lines file."""
        if self.otlp_endpoint:
            base = self.otlp_endpoint.rstrip("/")
            return base if base.endswith("/v1/traces") else f"{base}/v1/traces"
        if any(os.environ.get(name) for name in OTLP_ENDPOINT_VARIABLES):
            return ""  # the exporter resolves the standard variables itself
        return None

    @classmethod
    def from_value(cls, value: TracingConfig | Mapping[str, Any] | None) -> TracingConfig:
        if value is None:
            return cls()
        if isinstance(value, TracingConfig):
            return value
        return cls(**value)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class JsonLinesExporter(SpanExporter):
    """Appends finished spans to a file, one JSON object per line.

    The file is opened with O_APPEND and each batch is one ``write``, so processes on one host
    share the file without interleaving lines.
    """

    def __init__(self, path: str) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(s), separators=(",", ":")) + "\n" for s in spans)
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            os.write(self._fd, data.encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One line of the JSON-lines file: ids as lowercase hex (W3C), times in ns since the epoch."""
    context = span.get_span_context()
    assert context is not None
    parent = span.parent
    return {
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_span_id": None if parent is None else f"{parent.span_id:016x}",
        "name": span.name,
        "kind": span.kind.name,
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_unix_nano": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
        "status": {"code": span.status.status_code.name, "description": span.status.description},
        "service": span.resource.attributes.get("service.name"),
        "role": span.resource.attributes.get("service.role"),
        "process": span.resource.attributes.get("process.pid"),
    }


# -- the process's tracer -------------------------------------------------------------------

_tracer: Tracer | None = None  # None: tracing is off in this process
_provider: TracerProvider | None = None
_configured: TracingConfig | None = None
_propagator = TraceContextTextMapPropagator()


def configure(config: TracingConfig | Mapping[str, Any] | None, role: str) -> None:
    """Sets up this process's tracer for ``role`` (ingress, router, prefill, decode, ...).

    Called from each deployment's constructor; a second call with the same config is a no-op
    (Serve may construct several objects in one process), a different one replaces the first.
    """
    global _tracer, _provider, _configured
    config = TracingConfig.from_value(config)
    if config == _configured:
        return
    shutdown()
    _configured = config
    if not config.enabled:
        return
    url = config.otlp_url()
    exporter: SpanExporter
    if url is None:
        exporter = JsonLinesExporter(config.file)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=url or None)
    resource = Resource.create(
        {"service.name": config.service_name, "service.role": role, "process.pid": os.getpid()}
    )
    provider = TracerProvider(
        # A child follows its parent's sampled flag; root_span samples new traces itself.
        resource=resource,
        sampler=ParentBased(ALWAYS_ON),
    )
    provider.add_span_processor(
        BatchSpanProcessor(exporter, schedule_delay_millis=config.export_interval_s * 1000)
    )
    _provider = provider
    _tracer = provider.get_tracer("neuron_serve")


def shutdown() -> None:
    """Exports what is buffered and turns tracing off in this process."""
    global _tracer, _provider, _configured
    provider, _provider, _tracer, _configured = _provider, None, None, None
    if provider is not None:
        provider.shutdown()


def flush(timeout_s: float = 10.0) -> None:
    """Exports every finished span now (tests, shutdown)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


atexit.register(shutdown)


def enabled() -> bool:
    return _tracer is not None


# -- spans ----------------------------------------------------------------------------------


def _parent_context(parent: Parent) -> Context | None:
    """The context to start a child in, or None when there is no recording parent."""
    if parent is None:
        return None
    if isinstance(parent, _Current):
        span = trace.get_current_span()
    elif isinstance(parent, Mapping):
        span = trace.get_current_span(_propagator.extract(parent))
        context = span.get_span_context()
        if not (context.is_valid and context.trace_flags.sampled):
            return None
        return trace.set_span_in_context(span)
    else:
        span = parent
    if not span.is_recording():
        return None
    return trace.set_span_in_context(span)


@contextlib.contextmanager
def root_span(
    name: str, headers: Mapping[str, str], attributes: Attributes
) -> Iterator[Span | None]:
    """The request's root span (kind SERVER), made current; ``headers`` may carry the client's
    ``traceparent``/``tracestate``, whose trace it then continues."""
    if _tracer is None:
        yield None
        return
    if "traceparent" in headers:
        context = _propagator.extract(headers)  # the client decided whether it is sampled
    elif _configured is not None and random.random() >= _configured.sample_ratio:
        # Not sampled: decided before the SDK builds a (non-recording) span, which costs more.
        yield None
        return
    else:
        context = None
    span = _tracer.start_span(name, context, SpanKind.SERVER, attributes)
    if not span.is_recording():
        yield None
        return
    with trace.use_span(
        span, end_on_exit=True, record_exception=True, set_status_on_exception=True
    ):
        yield span


@contextlib.contextmanager
def span(
    name: str, parent: Parent = CURRENT, attributes: Attributes | None = None
) -> Iterator[Span | None]:
    """A child span around a block, current inside it; yields None (and records nothing)
    without a recording parent. Exceptions mark it as an error. Not for blocks that span an
    async generator's ``yield``: use ``start_span`` there."""
    child = start_span(name, parent, attributes)
    if child is None:
        yield None
        return
    with trace.use_span(
        child, end_on_exit=True, record_exception=True, set_status_on_exception=True
    ):
        yield child


def start_span(
    name: str,
    parent: Parent = CURRENT,
    attributes: Attributes | None = None,
    start_ns: int | None = None,
) -> Span | None:
    """A started child span that the caller ends (``end``); None without a recording parent."""
    if _tracer is None:
        return None
    context = _parent_context(parent)
    if context is None:
        return None
    return _tracer.start_span(name, context, attributes=attributes, start_time=start_ns)


def end(
    span: Span | None, error: BaseException | str | None = None, end_ns: int | None = None
) -> None:
    """Ends a span from ``start_span`` (None is fine), as an error when ``error`` is given."""
    if span is None:
        return
    if error is not None:
        set_error(span, error)
    span.end(end_time=end_ns)


def set_error(span: Span | None, error: BaseException | str) -> None:
    """Marks a span as failed with ``error`` (an exception is recorded as an event too)."""
    if span is None:
        return
    if isinstance(error, BaseException):
        span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, str(error)[:500]))


@contextlib.asynccontextmanager
async def ending(span: Span | None) -> AsyncIterator[Span | None]:
    """Ends ``span`` (None is fine) when the block exits; an exception marks it failed, a
    closed generator or a cancelled task (the client left) does not."""
    try:
        yield span
    except (GeneratorExit, asyncio.CancelledError):
        set_attributes(span, {"neuron_serve.closed_early": True})
        end(span)
        raise
    except BaseException as exc:
        end(span, exc)
        raise
    else:
        end(span)


def record_span(
    name: str,
    parent: Parent,
    start_ns: int,
    end_ns: int,
    attributes: Attributes | None = None,
) -> Span | None:
    """A span for something that already happened (timestamps in ns since the epoch)."""
    child = start_span(name, parent, attributes, start_ns=start_ns)
    if child is not None:
        child.end(end_time=max(start_ns, end_ns))
    return child


def set_attributes(span: Span | None, attributes: Attributes) -> None:
    """Sets the attributes whose value is not None (None span: nothing)."""
    if span is None:
        return
    span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def current_span() -> Span | None:
    """The current span if it records, else None."""
    if _tracer is None:
        return None
    span = trace.get_current_span()
    return span if span.is_recording() else None


def inject(parent: Parent = CURRENT) -> dict[str, str] | None:
    """The W3C headers (``traceparent``, ``tracestate``) that continue ``parent``'s trace in
    another process; None when there is nothing to continue (tracing off, not sampled)."""
    if _tracer is None:
        return None
    context = _parent_context(parent)
    if context is None:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context)
    return carrier or None


# -- engine timestamps -> spans -------------------------------------------------------------


def now_ns() -> int:
    return time.time_ns()


def monotonic_to_ns(t: float) -> int:
    """A ``time.monotonic()`` stamp as ns since the epoch (the engine stamps monotonic time)."""
    return time.time_ns() - int((time.monotonic() - t) * 1e9)


def engine_spans(
    parent: Parent,
    role: str,
    metrics: Mapping[str, float],
    finished_at: float,
    attributes: Attributes | None = None,
) -> None:
    """``{role}.queue`` and ``{role}.compute`` spans from an engine request's stamps.

    ``metrics`` is ``RequestOutput.metrics`` (arrival_time, first_scheduled_time,
    first_token_time; monotonic seconds); ``finished_at`` the monotonic time its last output
    left the engine. Queue: arrival -> first scheduled. Compute: first scheduled -> the end
    (for prefill the first token, for decode the last step), the steps aggregated in one span
    whose ``attributes`` say how many.
    """
    if _tracer is None:
        return
    arrival = metrics.get("arrival_time")
    scheduled = metrics.get("first_scheduled_time")
    if arrival is None:
        return
    if scheduled is None:  # never scheduled (aborted or failed while waiting)
        record_span(f"{role}.queue", parent, monotonic_to_ns(arrival), monotonic_to_ns(finished_at))
        return
    record_span(f"{role}.queue", parent, monotonic_to_ns(arrival), monotonic_to_ns(scheduled))
    record_span(
        f"{role}.compute",
        parent,
        monotonic_to_ns(scheduled),
        monotonic_to_ns(finished_at),
        attributes,
    )


def perf_to_ns(t: float) -> int:
    """A ``time.perf_counter()`` stamp as ns since the epoch."""
    return time.time_ns() - int((time.perf_counter() - t) * 1e9)


class KVTransferLike(Protocol):
    transport: str
    num_bytes: int
    seconds: float
    failed: bool


class EngineTrace:
    """One request's span on an engine replica (named ``role``: "prefill", "decode", "engine"),
    under the trace context the request carried; every method is a no-op when it carried none.

    ``follow`` wraps the engine's output stream: it notes each output's stamps and token count
    and, once the stream ends (finished, failed or closed), turns the last stamps into
    ``{role}.queue`` and ``{role}.compute`` spans and ends the span, unless ``end=False`` (the
    caller has more to do under it and calls ``end`` itself; a failed stream still ends it).
    """

    def __init__(
        self,
        role: str,
        trace_context: Mapping[str, str] | None,
        attributes: Attributes | None = None,
        started: float | None = None,
    ) -> None:
        self.role = role
        self.span: Span | None = None
        if trace_context is not None and _tracer is not None:
            start_ns = None if started is None else perf_to_ns(started)
            self.span = start_span(role, trace_context, attributes, start_ns=start_ns)
        self.metrics: Mapping[str, float] | None = None
        self.last_output = 0.0  # monotonic
        self.num_steps = 0
        self.num_tokens = 0

    async def follow(self, outputs: AsyncIterator[Any], end: bool = True) -> AsyncIterator[Any]:
        """The engine's ``RequestOutput`` stream, unchanged (closing this closes it)."""
        error: BaseException | None = None
        try:
            async for out in outputs:
                if self.span is not None:
                    self.metrics = out.metrics
                    self.last_output = time.monotonic()
                    self.num_steps += 1
                    self.num_tokens += sum(len(c.token_ids) for c in out.outputs)
                yield out
        except BaseException as exc:
            error = exc
            raise
        finally:
            close = getattr(outputs, "aclose", None)
            if close is not None:
                await close()
            if isinstance(error, GeneratorExit | asyncio.CancelledError):
                # Closed early (the client left): the request's span ends here in any case.
                set_attributes(self.span, {"neuron_serve.closed_early": True})
                self.end()
            elif end or error is not None:
                self.end(error)

    def kv(self, name: str, info: KVTransferLike, started: float) -> None:
        """A KV handoff phase (``info``: deployments.protocol.KVTransferInfo) that began at
        ``started`` (perf_counter) and took ``info.seconds``."""
        if self.span is None:
            return
        start_ns = perf_to_ns(started)
        attributes = {
            "neuron_serve.kv.transport": info.transport,
            "neuron_serve.kv.num_bytes": info.num_bytes,
            "neuron_serve.kv.failed": info.failed,
        }
        child = record_span(
            name, self.span, start_ns, start_ns + int(info.seconds * 1e9), attributes
        )
        if child is not None and info.failed:
            child.set_status(Status(StatusCode.ERROR, "the KV transfer failed"))

    def end(self, error: BaseException | str | None = None) -> None:
        """Records the queue and compute spans and ends the request's span (once)."""
        span, self.span = self.span, None
        if span is None:
            return
        if self.metrics is not None:
            steps = {
                "neuron_serve.num_steps": self.num_steps,
                "neuron_serve.num_tokens": self.num_tokens,
            }
            engine_spans(span, self.role, self.metrics, self.last_output, steps)
        end(span, error)
