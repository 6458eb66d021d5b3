"""Engine replicas' metrics through ``ray.util.metrics``: the Ray dashboard and every node's port.

The ingress renders vLLM's names at ``GET /metrics`` (app/metrics.py); these are the same
engine figures per replica, exported by Ray's metrics agent on each node's metrics port
(``metrics-export-port``, what the PodMonitor of configs/grafana/ scrapes) and shown in the Ray
dashboard's metrics view. Ray prefixes every name with ``ray_``; counters here end in
``_total`` so Ray exports them under exactly that name; histograms add ``_bucket``, ``_sum`` and
``_count``. Tags: ``deployment`` (PrefillServer, DecodeServer, LLMServer) and ``model_name``.

Gauges and counters follow the engine's stats snapshot, taken whenever Serve probes the
replica (``check_health``, every health_check_period_s) or asks for autoscaling stats; the
time-to-first-token and queue-time histograms are observed as requests finish, and the recent
TTFTs are what the replica reports to the autoscaling policy (router/autoscaling.py). Online
validation's counters and error histogram are observed as each check ends or is dropped.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

from ray.util import metrics

from neuron_runtime.accuracy.online import OnlineCheck
from neuron_runtime.engine import EngineStats
from neuron_runtime.outputs import RequestOutput
from neuron_runtime.spec_decode import metrics as spec_metrics

LATENCY_BOUNDARIES = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0]
TAG_KEYS = ("deployment", "model_name")

# name -> (kind, description, EngineStats field or None for histograms)
METRICS: dict[str, tuple[str, str, str | None]] = {
    "neuron_serve_num_requests_running": (
        "gauge",
        "Requests in the engine's running batch",
        "num_running",
    ),
    "neuron_serve_num_requests_waiting": ("gauge", "Requests waiting in the engine", "num_waiting"),
    "neuron_serve_kv_cache_usage_perc": (
        "gauge",
        "Fraction of KV blocks in use (1 = full)",
        "kv_cache_usage",
    ),
    "neuron_serve_kv_blocks_free": ("gauge", "Free KV cache blocks", "num_kv_blocks_free"),
    "neuron_serve_preemptions_total": ("counter", "Preemptions by the engine", "num_preemptions"),
    "neuron_serve_prefix_cache_queries_total": (
        "counter",
        "Prompt tokens looked up in the prefix cache",
        "prefix_cache_queries",
    ),
    "neuron_serve_prefix_cache_hits_total": (
        "counter",
        "Prompt tokens found in the prefix cache",
        "prefix_cache_hits",
    ),
    "neuron_serve_kv_exports_total": (
        "counter",
        "Requests handed off to decode (prefill role)",
        "num_kv_exports",
    ),
    "neuron_serve_kv_imports_total": (
        "counter",
        "Requests continued from another engine's KV (decode role)",
        "num_kv_imports",
    ),
    "neuron_serve_requests_aborted_total": (
        "counter",
        "Requests aborted before they finished (a client left)",
        "num_aborted",
    ),
    "neuron_serve_time_to_first_token_seconds": (
        "histogram",
        "Arrival at this engine to its first token",
        None,
    ),
    "neuron_serve_queue_time_seconds": (
        "histogram",
        "Arrival at this engine to its first scheduled step",
        None,
    ),
}

# Speculative decoding counters under vLLM's names (spec_decode/metrics.py), as vLLM's own Ray
# metrics name them: ":" becomes "_" (ray_vllm_spec_decode_num_drafts_total, ...).
SPEC_DECODE_METRICS: dict[str, str] = {
    spec_metrics.NUM_DRAFTS: "Verify steps that carried draft tokens",
    spec_metrics.NUM_DRAFT_TOKENS: "Draft tokens proposed",
    spec_metrics.NUM_ACCEPTED_TOKENS: "Draft tokens accepted",
    spec_metrics.NUM_ACCEPTED_TOKENS_PER_POS: "Draft tokens accepted, by draft position",
}


def spec_decode_ray_name(vllm_name: str) -> str:
    return vllm_name.replace(":", "_") + "_total"


# Online validation (neuron_runtime/accuracy/online.py), observed as each check ends; Ray
# names them like the spec-decode counters (ray_neuron_online_validation_checks_total, ...).
ONLINE_CHECKS = "neuron:online_validation_checks"
ONLINE_FAILURES = "neuron:online_validation_failures"
ONLINE_DROPPED = "neuron:online_validation_dropped"
ONLINE_MAX_ABS_ERROR = "neuron:online_validation_max_abs_error"
ONLINE_VALIDATION_METRICS: dict[str, tuple[str, str]] = {
    ONLINE_CHECKS: ("counter", "Sampled requests whose prompt logits were checked"),
    ONLINE_FAILURES: ("counter", "Checked requests past tolerance"),
    ONLINE_DROPPED: ("counter", "Sampled requests not checked (the check queue was full)"),
    ONLINE_MAX_ABS_ERROR: (
        "histogram",
        "Largest absolute logit error at a checked prompt's last position",
    ),
}
ERROR_BOUNDARIES = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0]


def online_ray_name(name: str) -> str:
    kind = ONLINE_VALIDATION_METRICS[name][0]
    return name.replace(":", "_") + ("_total" if kind == "counter" else "")


# The engine replica of this process (EngineReplica sets it; Serve runs one replica per actor).
current: EngineMetrics | None = None


def exported_series() -> set[str]:
    """The Prometheus series names Ray exports for METRICS (what dashboards may query)."""
    names: set[str] = set()
    for name, (kind, _, _) in METRICS.items():
        base = f"ray_{name}"
        if kind == "histogram":
            names |= {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
        else:
            names.add(base)
    names |= {f"ray_{spec_decode_ray_name(name)}" for name in SPEC_DECODE_METRICS}
    for name, (kind, _) in ONLINE_VALIDATION_METRICS.items():
        base = f"ray_{online_ray_name(name)}"
        if kind == "histogram":
            names |= {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
        else:
            names.add(base)
    return names


class EngineMetrics:
    """One engine replica's instruments; ``record`` is False outside a Ray worker (the recent
    TTFT window still works, for the autoscaling stats)."""

    def __init__(
        self, deployment: str, model_name: str, record: bool = True, ttft_window_s: float = 30.0
    ) -> None:
        self.ttft_window_s = ttft_window_s
        self._recent_ttft: deque[tuple[float, float]] = deque()
        self._last_totals: dict[str, float] = {}
        self._instruments: dict[str, Any] = {}
        if not record:
            return
        tags = {"deployment": deployment, "model_name": model_name}
        for name, (kind, description, _) in METRICS.items():
            instrument: metrics.Metric
            if kind == "gauge":
                instrument = metrics.Gauge(name, description, tag_keys=TAG_KEYS)
            elif kind == "counter":
                instrument = metrics.Counter(name, description, tag_keys=TAG_KEYS)
            else:
                instrument = metrics.Histogram(
                    name, description, boundaries=LATENCY_BOUNDARIES, tag_keys=TAG_KEYS
                )
            instrument.set_default_tags(tags)
            self._instruments[name] = instrument
        for name, description in SPEC_DECODE_METRICS.items():
            per_pos = name == spec_metrics.NUM_ACCEPTED_TOKENS_PER_POS
            counter = metrics.Counter(
                spec_decode_ray_name(name),
                description,
                tag_keys=(*TAG_KEYS, "position") if per_pos else TAG_KEYS,
            )
            counter.set_default_tags(tags)
            self._instruments[name] = counter
        for name, (kind, description) in ONLINE_VALIDATION_METRICS.items():
            if kind == "counter":
                instrument = metrics.Counter(online_ray_name(name), description, tag_keys=TAG_KEYS)
            else:
                instrument = metrics.Histogram(
                    online_ray_name(name), description, ERROR_BOUNDARIES, tag_keys=TAG_KEYS
                )
            instrument.set_default_tags(tags)
            self._instruments[name] = instrument

    def observe_stats(self, stats: EngineStats) -> None:
        """Gauges to the snapshot; counters by what the engine's totals grew since the last."""
        for name, (kind, _, field) in METRICS.items():
            instrument = self._instruments.get(name)
            if instrument is None or field is None:
                continue
            value = float(getattr(stats, field))
            if kind == "gauge":
                instrument.set(value)
            else:
                grown = value - self._last_totals.get(name, 0.0)
                if grown > 0:
                    instrument.inc(grown)
                self._last_totals[name] = value
        if stats.spec_decode is not None:
            for name, labels, total in stats.spec_decode.metrics():
                key = f"{name}/{labels.get('position', '')}"
                grown = float(total) - self._last_totals.get(key, 0.0)
                if grown > 0 and name in self._instruments:
                    self._instruments[name].inc(grown, tags=labels or None)
                self._last_totals[key] = float(total)

    def observe_finished(self, out: RequestOutput) -> None:
        """A request's time to first token and queue time at this engine."""
        arrival = out.metrics.get("arrival_time")
        first_token = out.metrics.get("first_token_time")
        scheduled = out.metrics.get("first_scheduled_time")
        if arrival is None:
            return
        if first_token is not None:
            ttft = max(0.0, first_token - arrival)
            self._recent_ttft.append((time.monotonic(), ttft))
            self._observe("neuron_serve_time_to_first_token_seconds", ttft)
        if scheduled is not None:
            self._observe("neuron_serve_queue_time_seconds", max(0.0, scheduled - arrival))

    def observe_online_check(self, check: OnlineCheck) -> None:
        """One online validation check (called on the validator's thread)."""
        self._inc(ONLINE_CHECKS)
        if not check.passed:
            self._inc(ONLINE_FAILURES)
        if math.isfinite(check.max_abs):  # NaN logits fail the check; no bucket holds them
            self._observe(ONLINE_MAX_ABS_ERROR, check.max_abs)

    def observe_online_drop(self) -> None:
        self._inc(ONLINE_DROPPED)

    def recent_ttft_s(self) -> float:
        """Mean time to first token of the requests finished in the last ttft_window_s (0 when
        none did: no signal)."""
        horizon = time.monotonic() - self.ttft_window_s
        while self._recent_ttft and self._recent_ttft[0][0] < horizon:
            self._recent_ttft.popleft()
        if not self._recent_ttft:
            return 0.0
        return sum(t for _, t in self._recent_ttft) / len(self._recent_ttft)

    def _observe(self, name: str, value: float) -> None:
        instrument = self._instruments.get(name)
        if instrument is not None:
            instrument.observe(value)

    def _inc(self, name: str) -> None:
        instrument = self._instruments.get(name)
        if instrument is not None:
            instrument.inc()
