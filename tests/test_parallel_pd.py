"""A disaggregated app whose roles run different parallel degrees, from the builder's args:
``decode: {engine_args: {tensor_parallel_size: 2}}`` (rank 1 an actor in the decode replica's
placement group of two bundles) and ``prefill: {engine_args: {data_parallel_size: 2}}`` (two
TP=1 prefill replicas). The KV travels as a payload through the object store and the TP=2
decode engine re-splits it over its ranks' heads. Through the official OpenAI client the app
answers completions, chat, streaming, n=2, seeded sampling and logprobs exactly as the offline
TP=1 engine does (logprobs within 1e-4); every replica ends idle.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.ray

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
from conftest import busy_engines  # noqa: E402
from ray import serve  # noqa: E402

from neuron_runtime import LLM, SamplingParams  # noqa: E402

MAX_MODEL_LEN = 128
NUM_KV_BLOCKS = 48
LOGPROB_ATOL = 1e-4
PROMPTS = [[5 + (7 * i + j) % 300 for j in range(3 + 9 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def app_url(serve_cluster, tiny_llama_path):
    from app.builder import BuildArgs, build_openai_app, validate_args

    args = BuildArgs(
        mode="disaggregated",
        model=str(tiny_llama_path),
        served_model_name="tiny",
        max_model_len=MAX_MODEL_LEN,
        num_threads=1,
        embedding_model=None,
        engine_args={"num_kv_blocks": NUM_KV_BLOCKS},
        prefill={"engine_args": {"data_parallel_size": 2}},
        decode={"engine_args": {"tensor_parallel_size": 2}},
        disaggregation={"kv_transport": "object_store", "prefill_routing": "power_of_two"},
    )
    validate_args(args)
    small = {"ray_actor_options": {"num_cpus": 0.05}}
    app = build_openai_app(args, prefill_options=small, decode_options=small, ingress_options=small)
    serve.run(app, name="pdtp", route_prefix="/pdtp")
    try:
        yield f"{serve_cluster}/pdtp"
    finally:
        serve.delete("pdtp")


@pytest.fixture(scope="module")
def offline(tiny_llama_path) -> LLM:
    return LLM(
        model=str(tiny_llama_path),
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=NUM_KV_BLOCKS,
        num_threads=1,
    )


def _client(url: str):  # noqa: ANN202
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _replica_stats(deployment: str, num_replicas: int) -> dict[str, dict]:
    handle = serve.get_deployment_handle(deployment, app_name="pdtp")
    seen: dict[str, dict] = {}
    for _ in range(60):
        stats = handle.stats.remote().result(timeout_s=30)
        seen[stats["replica_id"]] = stats
        if len(seen) == num_replicas:
            return seen
    raise AssertionError(f"saw {len(seen)} of {num_replicas} {deployment} replicas")


def _wait_idle() -> dict[str, dict]:
    deadline = time.monotonic() + 60
    while True:
        prefill = _replica_stats("PrefillServer", 2)
        decode = _replica_stats("DecodeServer", 1)
        busy = busy_engines([*prefill.values(), *decode.values()])
        if not busy:
            return prefill
        assert time.monotonic() < deadline, f"not idle: {busy}"
        time.sleep(0.3)


def _pd_config(args: dict, deployments: list[dict]) -> dict:
    base = {"mode": "disaggregated", "max_model_len": 256, "embedding_model": None}
    app = {"name": "pd", "import_path": "app.builder:build_app", "args": {**base, **args}}
    return {"applications": [{**app, "deployments": deployments}]}


@pytest.mark.parametrize(
    ("args", "deployments", "message"),
    [
        (
            {"decode": {"engine_args": {"tensor_parallel_size": 2}}},
            [],
            "decode tensor_parallel_size 2 needs disaggregation.kv_transport 'object_store'",
        ),
        (
            {"prefill": {"engine_args": {"tensor_parallel_size": 4}}},
            [],
            "prefill.engine_args: model 'smollm2-135m-instruct': tensor_parallel_size 4 cannot",
        ),
        (
            {"mode": "colocated", "decode": {"engine_args": {"tensor_parallel_size": 2}}},
            [],
            "decode.engine_args needs mode 'disaggregated'",
        ),
        (
            {
                "decode": {"engine_args": {"tensor_parallel_size": 2}},
                "disaggregation": {"kv_transport": "object_store"},
            },
            [{"name": "DecodeServer", "ray_actor_options": {"num_cpus": 1}}],
            "'DecodeServer': with tensor_parallel_size 2 and its ray_actor_options set here, set "
            "placement_group_bundles too",
        ),
        (
            {
                "decode": {"engine_args": {"tensor_parallel_size": 2}},
                "disaggregation": {"kv_transport": "object_store"},
            },
            [{"name": "DecodeServer", "placement_group_bundles": [{"CPU": 1}]}],
            r"'DecodeServer': tensor_parallel_size 2 needs 2 placement_group_bundles \(one per "
            r"rank\), got 1",
        ),
    ],
)
def test_per_role_settings_the_app_cannot_take_are_refused_at_build(args, deployments, message):
    from app.config_check import check_config

    with pytest.raises(ValueError, match=message):
        check_config(_pd_config(args, deployments))


def test_tp2_decode_tp1_prefill_answers_like_the_offline_tp1_engine(app_url, offline):
    client = _client(app_url)
    ranks = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("neuron-tp-rank1-")
    ]
    assert len(ranks) == 1  # the decode replica's second rank; the prefill replicas have none

    # Concurrent greedy completions with logprobs (spread over both prefill replicas).
    def complete(i: int):  # noqa: ANN202
        return client.completions.create(
            model="tiny", prompt=PROMPTS[i], max_tokens=4 + 2 * i, temperature=0, logprobs=2
        ).choices[0]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        served = list(pool.map(complete, range(len(PROMPTS))))
    for i, choice in enumerate(served):
        params = SamplingParams(temperature=0, max_tokens=4 + 2 * i, logprobs=2)
        want = offline.generate({"prompt_token_ids": PROMPTS[i]}, params)[0].outputs[0]
        assert choice.text == want.text
        got = choice.logprobs.token_logprobs
        ids = want.token_ids
        assert len(got) == len(ids)
        for value, token, entry in zip(got, ids, want.logprobs, strict=True):
            assert value == pytest.approx(entry[token], abs=LOGPROB_ATOL)

    # Chat, greedy.
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0
    )
    want_chat = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10))[0]
    assert reply.choices[0].message.content == want_chat.outputs[0].text
    assert reply.usage.completion_tokens == len(want_chat.outputs[0].token_ids)

    # n=2 with a seed, whole and streamed.
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=7)
    whole = client.completions.create(**kwargs, n=2)
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(**kwargs, n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8)
    expected = [c.text for c in offline.generate("Once upon a time", params)[0].outputs]
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == expected
    assert [streamed[0], streamed[1]] == expected

    # Every prompt was prefilled once and its KV imported by the TP=2 decode engine.
    prefill = _wait_idle()
    exports = [s["num_kv_exports"] for s in prefill.values()]
    assert all(n > 0 for n in exports), exports  # the router used both DP replicas
    decode = next(iter(_replica_stats("DecodeServer", 1).values()))
    assert decode["num_kv_imports"] == sum(exports)
