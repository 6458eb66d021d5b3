"""Prometheus metrics with vLLM's names, rendered by the ingress at ``GET /metrics``.

Request-side numbers (latencies, token counts) are observed by the ingress as it streams.
Engine-side numbers (running/waiting, KV usage, preemptions, prefix cache) come from the LLM
replicas' ``stats()``: every finished stream carries its replica's snapshot, and each scrape
asks one replica for a fresh one; the gauges sum the latest snapshot of every replica heard
from in the last ``stale_after_s`` seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from deployments.protocol import EncodeResult

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _EngineStatsCollector:
    def __init__(self, model_name: str, stale_after_s: float) -> None:
        self.model_name = model_name
        self.stale_after_s = stale_after_s
        self.replicas: dict[str, tuple[float, dict[str, Any]]] = {}

    def update(self, stats: dict[str, Any]) -> None:
        self.replicas[str(stats.get("replica_id", "?"))] = (time.monotonic(), stats)

    def collect(self) -> Iterator[Metric]:
        now = time.monotonic()
        fresh = [s for t, s in self.replicas.values() if now - t <= self.stale_after_s]

        def total(key: str) -> float:
            return float(sum(s.get(key, 0) for s in fresh))

        labels = ["model_name"]
        gauges = (
            ("vllm:num_requests_running", "Requests in the engines' running batch", "num_running"),
            ("vllm:num_requests_waiting", "Requests waiting in the engines", "num_waiting"),
        )
        for name, doc, key in gauges:
            metric = GaugeMetricFamily(name, doc, labels=labels)
            metric.add_metric([self.model_name], total(key))
            yield metric
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", labels=labels
        )
        used, blocks = total("num_kv_blocks_used"), total("num_kv_blocks_total")
        usage.add_metric([self.model_name], used / blocks if blocks else 0.0)
        yield usage
        counters = (
            ("vllm:num_preemptions", "Preemptions by the engines", "num_preemptions"),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up", "prefix_cache_queries"),
            ("vllm:prefix_cache_hits", "Prompt tokens found cached", "prefix_cache_hits"),
            ("neuron:kv_exports", "Requests handed off by prefill replicas", "num_kv_exports"),
            ("neuron:kv_imports", "Requests continued by decode replicas", "num_kv_imports"),
            ("neuron:requests_aborted", "Requests the engines aborted unfinished", "num_aborted"),
        )
        for name, doc, key in counters:
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric([self.model_name], total(key))
            yield counter
        yield from self._spec_decode(fresh)

    def _spec_decode(self, fresh: list[dict[str, Any]]) -> Iterator[Metric]:
        """vLLM's speculative decoding counters, summed over the replicas that speculate
        (their snapshot's ``spec_decode``, EngineStats.spec_decode); none when no replica does."""
        spec = [s["spec_decode"] for s in fresh if s.get("spec_decode")]
        if not spec:
            return
        labels = ["model_name"]
        counters = (
            ("vllm:spec_decode_num_drafts", "Verify steps with draft tokens", "num_drafts"),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", "num_draft_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "Accepted drafts", "num_accepted_tokens"),
        )
        for name, doc, key in counters:
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric([self.model_name], float(sum(s.get(key, 0) for s in spec)))
            yield counter
        per_pos: list[float] = []
        for s in spec:
            for pos, count in enumerate(s.get("num_accepted_tokens_per_pos", ())):
                per_pos.extend([0.0] * (pos + 1 - len(per_pos)))
                per_pos[pos] += count
        counter = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position",
            labels=[*labels, "position"],
        )
        for pos, count in enumerate(per_pos):
            counter.add_metric([self.model_name, str(pos)], count)
        yield counter


class ServingMetrics:
    """One registry per ingress replica; labels carry the served model name."""

    def __init__(self, model_name: str, stale_after_s: float = 300.0) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.engine = _EngineStatsCollector(model_name, stale_after_s)
        self.registry.register(self.engine)
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated", labels, registry=r
        ).labels(model_name)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between streamed tokens",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency, arrival to last token",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.kv_transfer_seconds = Histogram(
            "neuron:kv_transfer_seconds",
            "KV handoff time: export (prefill side, part of TTFT) and import (decode side)",
            [*labels, "transport", "stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "neuron:kv_transfer_bytes",
            "KV bytes moved from prefill to decode replicas",
            [*labels, "transport"],
            registry=r,
        )
        self.kv_transfer_failures = Counter(
            "neuron:kv_transfer_failures",
            "KV fetches that failed or timed out (the prompt was recomputed or the request failed)",
            labels,
            registry=r,
        ).labels(model_name)
        self.request_migrations = Counter(
            "neuron:request_migrations",
            "Requests resumed on another replica after theirs was lost mid-stream",
            labels,
            registry=r,
        ).labels(model_name)
        self.encoder_queue_time = Histogram(
            "neuron:encoder_queue_time_seconds",
            "Time an image waited for a vision encoder batch",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.encode_time = Histogram(
            "neuron:encode_time_seconds",
            "Vision encoder batch time (preprocess, tower, projector) of an encoded image",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.mm_cache_queries = Counter(
            "vllm:mm_cache_queries", "Images looked up in the encoders' caches", labels, registry=r
        ).labels(model_name)
        self.mm_cache_hits = Counter(
            "vllm:mm_cache_hits", "Images found in the encoders' caches", labels, registry=r
        ).labels(model_name)
        self.mm_embedding_bytes = Counter(
            "neuron:mm_embedding_bytes",
            "Image embedding bytes handed from encoders to prefill replicas",
            labels,
            registry=r,
        ).labels(model_name)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time waiting before the engine scheduled it",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)

    def update_engine_stats(self, stats: dict[str, Any] | list[dict[str, Any]] | None) -> None:
        """One replica's snapshot, or a list of them (a PD router reports every replica)."""
        for snapshot in stats if isinstance(stats, list) else [stats] if stats else []:
            self.engine.update(snapshot)

    def observe_kv_transfer(
        self, transport: str, stage: str, num_bytes: int, seconds: float
    ) -> None:
        self.kv_transfer_seconds.labels(self.model_name, transport, stage).observe(seconds)
        if stage == "import":
            self.kv_transfer_bytes.labels(self.model_name, transport).inc(num_bytes)

    def observe_image_encode(self, result: EncodeResult) -> None:
        """What one image of a request cost the vision encoders."""
        self.mm_cache_queries.inc()
        if result.cache_hit:
            self.mm_cache_hits.inc()
        else:
            self.encoder_queue_time.observe(result.queue_seconds)
            self.encode_time.observe(result.encode_seconds)
        self.mm_embedding_bytes.inc(result.num_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's TTFT, ITL and E2E latency as its tokens arrive."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last: float | None = None

    def tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            # A step that brought several tokens spreads its gap over them.
            gap = (now - self.last) / num_tokens
            for _ in range(num_tokens):
                self.metrics.itl.observe(gap)
        self.last = now
        self.metrics.generation_tokens.inc(num_tokens)

    def finish(self) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.start)
