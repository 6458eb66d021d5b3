"""Engine metrics on Ray's own metrics endpoint (deployments/ray_metrics.py) while the app serves.

Ray's metrics agent exports every ``ray.util.metrics`` instrument of the node's workers on the
node's metrics export port, in Prometheus' text format: the port a PodMonitor scrapes and the
Ray dashboard's metrics view reads (through Prometheus). A colocated app on a fresh tiny model
(its path is the ``model_name`` label, so no other test's replica shares these series) answers
a few completions; then a gauge, a counter and a histogram read from that endpoint must equal
the engine's own figures: the replica's stats snapshot (``LLMServer.stats``) for the gauge and
the counter, the number of requests sent for the histogram's count, and the clients' measured
latencies bound its buckets.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
from conftest import busy_engines, make_tiny_llama  # noqa: E402
from ray import serve  # noqa: E402

pytestmark = pytest.mark.ray

APP = "ray-metrics"
NUM_REQUESTS = 3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, default_model_path) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("metrics-model"), default_model_path)


def samples(text: str, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """The samples of ``name`` in a Prometheus text exposition whose labels include ``labels``."""
    found = []
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        label_text, value = line[len(name) + 1 :].rsplit("} ", 1)
        parsed = {}
        for item in label_text.split('",'):
            key, _, raw = item.partition('="')
            parsed[key.strip(",")] = raw.rstrip('"')
        if all(parsed.get(k) == v for k, v in labels.items()):
            found.append((parsed, float(value)))
    return found


def test_engine_metrics_of_each_kind_reach_the_nodes_metrics_port(
    serve_cluster: str, model_path: Path
) -> None:
    from app.builder import BuildArgs, build_openai_app

    args = BuildArgs(
        model=str(model_path),
        max_model_len=256,
        embedding_model=None,
        engine_args={"num_kv_blocks": 64},
    )
    # Health probes (which sample the engine's stats into the gauges and counters) every
    # second, and the replica's instruments reported every second (Ray's default: 10 s).
    llm_options = {
        "health_check_period_s": 1,
        "ray_actor_options": {
            "num_cpus": 0.1,
            "runtime_env": {"env_vars": {"RAY_metrics_report_interval_ms": "1000"}},
        },
    }
    ingress_options = {"ray_actor_options": {"num_cpus": 0.1}}
    app = build_openai_app(args, llm_options=llm_options, ingress_options=ingress_options)
    serve.run(app, name=APP, route_prefix=f"/{APP}")
    try:
        api = openai.OpenAI(
            base_url=f"{serve_cluster}/{APP}/v1", api_key="unused", max_retries=0, timeout=60
        )
        latencies = []
        for i in range(NUM_REQUESTS):
            start = time.perf_counter()
            api.completions.create(
                model=str(model_path), prompt=f"Count to {i}:", max_tokens=4, temperature=0
            )
            latencies.append(time.perf_counter() - start)
        handle = serve.get_deployment_handle("LLMServer", app_name=APP)
        stats = handle.stats.remote().result(timeout_s=30)
        assert not busy_engines([stats])
        assert stats["prefix_cache_queries"] > 0

        node = ray._private.worker.global_worker.node
        url = f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"
        ours = {"deployment": "LLMServer", "model_name": str(model_path)}
        wanted = {
            # gauge: the replica's free KV blocks now
            "ray_neuron_serve_kv_blocks_free": float(stats["num_kv_blocks_free"]),
            # counter: prompt tokens looked up in the prefix cache since the replica started
            "ray_neuron_serve_prefix_cache_queries_total": float(stats["prefix_cache_queries"]),
            # histogram: one time-to-first-token observation per finished request
            "ray_neuron_serve_time_to_first_token_seconds_count": float(NUM_REQUESTS),
        }
        deadline = time.monotonic() + 60
        while True:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            got = {name: samples(text, name, **ours) for name in wanted}
            values = {name: [v for _, v in found] for name, found in got.items()}
            if all(values[name] == [value] for name, value in wanted.items()):
                break
            assert time.monotonic() < deadline, f"wanted {wanted}, the endpoint has {values}"
            time.sleep(1.0)

        # The buckets agree with the count and with the clients' latencies: a request's time to
        # first token at the engine is within its whole round trip, so at least as many
        # observations lie at or below each bound as requests finished within it. (Ray
        # rebuilds a histogram from bucket midpoints, so its _sum is approximate.)
        ttft = "ray_neuron_serve_time_to_first_token_seconds"
        buckets = {labels["le"]: v for labels, v in samples(text, f"{ttft}_bucket", **ours)}
        assert buckets.pop("+Inf") == NUM_REQUESTS
        for bound, count in buckets.items():
            assert count >= sum(1 for t in latencies if t <= float(bound)), (bound, latencies)
        # The engine is still the one that answered: the stats did not move meanwhile.
        assert (
            handle.stats.remote().result(timeout_s=30)["prefix_cache_queries"]
            == (stats["prefix_cache_queries"])
        )
    finally:
        serve.delete(APP)
