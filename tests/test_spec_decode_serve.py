"""Speculative decoding in the disaggregated app: ingress -> PDRouter -> prefill -> decode.

The app on the shared cluster (conftest.serve_cluster) serves the default model with
``speculative_config: {method: ngram, num_speculative_tokens: 3}`` in its engine args; the
decode replica speculates on every request it continues. A greedy chat request with a repetitive
prompt goes through the official OpenAI client over HTTP; its text must equal the offline
engine's greedy output without speculation, and the decode replica's speculative decoding
counters (vLLM's names) must show drafts and accepted tokens, the same on the replica's stats
snapshot, the app's /metrics and Ray's metrics port.
"""

from __future__ import annotations

import time
import urllib.request

import httpx
import pytest

pytestmark = pytest.mark.ray

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
from conftest import busy_engines, metric  # noqa: E402
from ray import serve  # noqa: E402

from neuron_runtime import LLM, SamplingParams  # noqa: E402

APP = "pdspec"
MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 512
SPEC = {"method": "ngram", "num_speculative_tokens": 3}
CHAT = [
    {
        "role": "user",
        "content": "Copy this list exactly, three times, one item per line: red apple, green "
        "pear, yellow banana, purple plum, orange peach. red apple, green pear, yellow banana, "
        "purple plum, orange peach.",
    }
]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def spec_server(serve_cluster):
    from app.builder import BuildArgs, build_openai_app

    small = {
        "ray_actor_options": {
            "num_cpus": 0.1,
            # Replicas report their Ray metrics every second (Ray's default: 10 s).
            "runtime_env": {"env_vars": {"RAY_metrics_report_interval_ms": "1000"}},
        }
    }
    app = build_openai_app(
        BuildArgs(
            mode="disaggregated",
            max_model_len=MAX_MODEL_LEN,
            embedding_model=None,
            engine_args={"num_kv_blocks": 64, "speculative_config": SPEC},
        ),
        prefill_options=small,
        # Health probes sample the engine's stats into the replica's Ray counters every second.
        decode_options={**small, "health_check_period_s": 1},
        ingress_options={"ray_actor_options": {"num_cpus": 0.1}},
    )
    serve.run(app, name=APP, route_prefix=f"/{APP}")
    try:
        yield serve_cluster
    finally:
        serve.delete(APP)


def stats(deployment: str) -> dict:
    return serve.get_deployment_handle(deployment, app_name=APP).stats.remote().result(timeout_s=30)


def ray_samples(text: str, name: str) -> float:
    """Sum of ``name``'s samples with this app's decode replica's tags on Ray's metrics port."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and 'deployment="DecodeServer"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_ngram_speculation_through_pd_app_equals_offline_greedy(spec_server) -> None:
    api = openai.OpenAI(
        base_url=f"{spec_server}/{APP}/v1", api_key="unused", max_retries=0, timeout=120
    )
    reply = api.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS
    )
    # Reference: the offline engine, no speculation.
    offline = LLM(model=MODEL, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
    expected = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    assert offline.engine.stats().spec_decode is None
    want = expected.outputs[0]
    assert reply.choices[0].message.content == want.text
    assert reply.usage.completion_tokens == len(want.token_ids)

    # The decode replica speculated: its engine's counters, and the same on the app's /metrics.
    decode = stats("DecodeServer")
    spec = decode["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] > 0
    assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"]
    assert sum(spec["num_accepted_tokens_per_pos"]) == spec["num_accepted_tokens"]
    text = httpx.get(f"{spec_server}/{APP}/metrics", timeout=30).text
    # The ingress sums every replica that speculates (the prefill replica's own drafts, if any).
    prefill_spec = stats("PrefillServer")["spec_decode"]
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert metric(text, f"vllm:spec_decode_{key}_total") == spec[key] + prefill_spec[key]
    assert metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == (
        spec["num_accepted_tokens"] + prefill_spec["num_accepted_tokens"]
    )

    # Ray's metrics port: the decode replica's counters, once its health probe sampled them.
    node = ray._private.worker.global_worker.node
    url = f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"
    wanted = {
        "ray_vllm_spec_decode_num_drafts_total": spec["num_drafts"],
        "ray_vllm_spec_decode_num_accepted_tokens_total": spec["num_accepted_tokens"],
        "ray_vllm_spec_decode_num_accepted_tokens_per_pos_total": spec["num_accepted_tokens"],
    }
    deadline = time.monotonic() + 20
    while True:
        ray_text = urllib.request.urlopen(url, timeout=10).read().decode()
        got = {name: ray_samples(ray_text, name) for name in wanted}
        if got == wanted:
            break
        assert time.monotonic() < deadline, f"wanted {wanted}, Ray's port has {got}"
        time.sleep(1.0)

    # Every engine back to idle.
    deadline = time.monotonic() + 30
    while busy_engines([stats("PrefillServer"), stats("DecodeServer")]):
        assert time.monotonic() < deadline
        time.sleep(0.3)


def test_spec_decode_counters_reach_app_metrics_and_ray_instruments() -> None:
    """Without a cluster: two replicas' snapshots (one speculating) summed at /metrics, and a
    replica's Ray counters grown by exactly what its engine's totals grew between probes."""
    import dataclasses

    from app.metrics import ServingMetrics
    from deployments.ray_metrics import EngineMetrics
    from neuron_runtime.engine import EngineStats
    from neuron_runtime.spec_decode.metrics import SpecDecodeStats

    serving = ServingMetrics("m")
    first = SpecDecodeStats(3, 9, 5, (3, 2, 0))
    serving.update_engine_stats(
        [
            {"replica_id": "a", "spec_decode": dataclasses.asdict(first)},
            {
                "replica_id": "b",
                "spec_decode": dataclasses.asdict(SpecDecodeStats(1, 3, 3, (1, 1, 1))),
            },
            {"replica_id": "c", "spec_decode": None},
        ]
    )
    text = serving.render().decode()
    assert metric(text, "vllm:spec_decode_num_drafts_total") == 4
    assert metric(text, "vllm:spec_decode_num_draft_tokens_total") == 12
    assert metric(text, "vllm:spec_decode_num_accepted_tokens_total") == 8
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 3.0'
        in text
    )
    assert "spec_decode" not in ServingMetrics("m").render().decode()  # nobody speculates

    replica = EngineMetrics("DecodeServer", "m", record=True)
    grown: dict[tuple[str, str], float] = {}

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def inc(self, value: float, tags: dict[str, str] | None = None) -> None:
            key = (self.name, (tags or {}).get("position", ""))
            grown[key] = grown.get(key, 0.0) + value

        def set(self, value: float) -> None:
            pass

    replica._instruments = {name: Recorder(name) for name in replica._instruments}
    base = {f.name: 0 for f in dataclasses.fields(EngineStats) if f.name != "spec_decode"}
    later = SpecDecodeStats(5, 15, 9, (4, 3, 2))
    replica.observe_stats(EngineStats(**base, spec_decode=first))
    replica.observe_stats(EngineStats(**base, spec_decode=later))
    replica.observe_stats(EngineStats(**base, spec_decode=later))  # nothing new
    assert grown[("vllm:spec_decode_num_drafts", "")] == 5
    assert grown[("vllm:spec_decode_num_draft_tokens", "")] == 15
    assert grown[("vllm:spec_decode_num_accepted_tokens", "")] == 9
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos"
    assert [grown[(per_pos, str(i))] for i in range(3)] == [4, 3, 2]
