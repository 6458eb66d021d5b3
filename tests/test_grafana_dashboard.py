"""configs/grafana/: every dashboard panel queries series the service exports.

The exported names come from the exporters themselves: the ingress registry rendered by
prometheus_client (what GET /metrics returns, vLLM's names) and the names Ray's metrics agent
gives the engine replicas' ray.util.metrics instruments (deployments/ray_metrics.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app.metrics import ServingMetrics
from deployments import ray_metrics
from neuron_runtime.outputs import RequestOutput

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "configs" / "grafana" / "neuron-serve-dashboard.json"
# Series of this service: the ingress's vllm:/neuron: names and the replicas' ray_neuron_serve_*.
OURS = re.compile(r"\b(?:vllm:|neuron:|ray_neuron_serve_)[a-zA-Z0-9_:]*")


def ingress_series() -> set[str]:
    metrics = ServingMetrics("m")
    # Labelled by transport and stage: exported once a handoff is observed.
    metrics.observe_kv_transfer("nixl", "import", 1024, 0.01)
    text = generate_latest(metrics.registry).decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_panel_queries_exported_series() -> None:
    exported = ingress_series() | ray_metrics.exported_series()
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        names = {n for t in panel["targets"] for n in OURS.findall(t["expr"])}
        assert names, f"panel {panel['title']!r} queries none of the service's series"
        assert names <= exported, (panel["title"], sorted(names - exported))


def test_the_dashboard_shows_engine_metrics_through_ray() -> None:
    exprs = " ".join(
        t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]
    )
    queried = set(OURS.findall(exprs))
    for name, (kind, _, _) in ray_metrics.METRICS.items():
        series = f"ray_{name}_bucket" if kind == "histogram" else f"ray_{name}"
        assert series in queried, series


def test_podmonitor_scrapes_the_ports_the_manifests_open() -> None:
    monitor = yaml.safe_load((ROOT / "configs" / "grafana" / "podmonitor.yaml").read_text())
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    manifest = yaml.safe_load((ROOT / "configs" / "kuberay" / "rayservice-trn1.yaml").read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        (container,) = group["template"]["spec"]["containers"]
        assert ports <= {p["name"] for p in container["ports"]}


def test_recent_ttft_is_the_window_mean() -> None:
    metrics = ray_metrics.EngineMetrics("PrefillServer", "m", record=False, ttft_window_s=60)
    assert metrics.recent_ttft_s() == 0.0
    for arrival, first in ((10.0, 10.5), (20.0, 21.5)):
        out = RequestOutput(
            "r", None, [1], [], True, metrics={"arrival_time": arrival, "first_token_time": first}
        )
        metrics.observe_finished(out)
    assert metrics.recent_ttft_s() == pytest.approx(1.0)
    metrics.ttft_window_s = 0.0
    assert metrics.recent_ttft_s() == 0.0
