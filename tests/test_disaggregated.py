"""Disaggregated serving on a local Ray cluster: ingress -> PDRouter -> prefill -> decode.

Applications on the shared cluster (conftest.serve_cluster):
- ``pd`` (/pd): the real default model, two prefill replicas and one decode replica, the KV
  through NIXL (the default transport: the decode replica reads the prefill blocks);
- ``colo`` (/colo): the same model colocated (one LLMServer), the baseline;
- ``pdfault`` (/pdfault): a tiny random-weight Llama over NIXL, prefill replicas whose engine
  exits the process on a marked request (once), for the failure cases; a short hold timeout,
  so blocks nobody reads are freed within the test; reads layer-wise (``pd``'s are whole, the
  default over UCX);
- ``pdobj`` (/pdobj): the tiny Llama, the KV through Ray's object store; prompts of up to
  ``LOCAL_PREFILL_TOKENS`` prefilled by the decode replica itself;
- ``pddirect`` (/pddirect): ``pdobj`` with direct_decode: those short prompts go from the
  ingress straight to the decode replica, not through the PD router.
References: the offline ``LLM`` on the same weights, and the colocated app. The KV fetch policy
is checked for both transports on a DecodeServer outside Serve. After each test every engine
replica is back to its idle baseline: no request, no used or held KV block.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.ray

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
from conftest import busy_engines, metric  # noqa: E402
from ray import serve  # noqa: E402

from neuron_runtime import LLM, AsyncEngine, SamplingParams  # noqa: E402

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 1024
SYSTEM_PROMPTS = [
    "You are a helpful assistant who answers questions about geography in one sentence. "
    "Always name the country and the continent, and never use lists or bullet points.",
    "You are a careful math tutor. Explain every step of a calculation in plain words, check "
    "the result at the end, and keep the whole answer under fifty words.",
    "You are a poet who answers every question with a short rhyming couplet about the sea, "
    "the wind and the stars, whatever the topic of the question is.",
]
QUESTIONS = [
    "What is the capital of France?",
    "Tell me about the Nile river and the cities along it.",
    "How many legs does a spider have?",
    "Why is the sky blue during the day and red at sunset?",
]
DIE_MARKER_ENV = "NEURON_SERVE_TEST_DIE_MARKER"
# The pdobj app's max_local_prefill_tokens.
LOCAL_PREFILL_TOKENS = 16


class DieOnceEngine(AsyncEngine):
    """An AsyncEngine whose prefill role exits the process while a marker file exists, once:
    the first replica to see a prefill request deletes the marker and dies mid-call."""

    async def generate(self, prompt, params, request_id=None, kind=None, **kwargs):  # noqa: ANN001, ANN201
        marker = os.environ.get(DIE_MARKER_ENV)
        if kwargs.get("export_kv") and marker and os.path.exists(marker):
            os.remove(marker)
            os._exit(1)
        async for out in super().generate(prompt, params, request_id, kind, **kwargs):
            yield out


# -- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pd_server(serve_cluster):
    from app.builder import BuildArgs, build_openai_app

    engine_args = {"num_kv_blocks": 256}
    small = {"ray_actor_options": {"num_cpus": 0.1}}
    pd = build_openai_app(
        BuildArgs(
            mode="disaggregated",
            max_model_len=MAX_MODEL_LEN,
            embedding_model=None,
            engine_args=engine_args,
        ),
        prefill_options={"num_replicas": 2, **small},
        decode_options=small,
        ingress_options=small,
    )
    colo = build_openai_app(
        BuildArgs(max_model_len=MAX_MODEL_LEN, embedding_model=None, engine_args=engine_args),
        llm_options=small,
        ingress_options=small,
    )
    serve.run(pd, name="pd", route_prefix="/pd")
    serve.run(colo, name="colo", route_prefix="/colo")
    try:
        yield serve_cluster
    finally:
        serve.delete("pd")
        serve.delete("colo")


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model=MODEL, max_model_len=MAX_MODEL_LEN, num_kv_blocks=256)


def client(base: str, prefix: str):
    return openai.OpenAI(
        base_url=f"{base}{prefix}/v1", api_key="unused", max_retries=0, timeout=180
    )


def replica_stats(deployment: str, app: str, num_replicas: int) -> dict[str, dict]:
    """Fresh stats of every replica of a deployment (its router picks replicas at random)."""
    handle = serve.get_deployment_handle(deployment, app_name=app)
    seen: dict[str, dict] = {}
    for _ in range(60):
        stats = handle.stats.remote().result(timeout_s=30)
        seen[stats["replica_id"]] = stats
        if len(seen) == num_replicas:
            return seen
    raise AssertionError(f"saw {len(seen)} of {num_replicas} {deployment} replicas")


def router_total(app: str, key: str) -> int:
    """A counter of the PD router's own stats (one router replica)."""
    handle = serve.get_deployment_handle("PDRouter", app_name=app)
    stats = handle.stats.remote().result(timeout_s=30)
    return sum(s.get(key, 0) for s in stats)


def router_kv_refs(app: str) -> int:
    return router_total(app, "num_kv_refs_held")


def wait_idle(app: str, num_prefill: int, timeout_s: float = 60.0) -> None:
    """Every prefill and decode replica back to an empty engine, the router holding no KV."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [
            *replica_stats("PrefillServer", app, num_prefill).values(),
            *replica_stats("DecodeServer", app, 1).values(),
        ]
        busy = busy_engines(stats)
        refs = router_kv_refs(app)
        if not busy and refs == 0:
            return
        assert time.monotonic() < deadline, f"not idle: {busy}, router KV refs {refs}"
        time.sleep(0.3)


# -- correctness --------------------------------------------------------------------------


def test_concurrent_mixed_greedy_equals_colocated_and_offline(pd_server, offline):
    chats = [
        [{"role": "system", "content": SYSTEM_PROMPTS[i % 3]}, {"role": "user", "content": q}]
        for i, q in enumerate(QUESTIONS + QUESTIONS[:2])
    ]
    chats.append([{"role": "user", "content": "Hi"}])
    lengths = [8 + 5 * i for i in range(len(chats))]

    def ask(prefix: str, i: int) -> tuple[str, int]:
        reply = client(pd_server, prefix).chat.completions.create(
            model=MODEL, messages=chats[i], temperature=0, max_tokens=lengths[i]
        )
        return reply.choices[0].message.content, reply.usage.completion_tokens

    delivered = router_total("pd", "num_handoffs_delivered")
    with ThreadPoolExecutor(len(chats)) as pool:
        pd = list(pool.map(lambda i: ask("/pd", i), range(len(chats))))
        colo = list(pool.map(lambda i: ask("/colo", i), range(len(chats))))
    # Decode first (the nixl default): every handoff went from the prefill replica straight
    # to the decode replica waiting for it.
    assert router_total("pd", "num_handoffs_delivered") - delivered == len(chats)
    expected = [
        offline.chat(chat, SamplingParams(temperature=0, max_tokens=n))[0].outputs[0]
        for chat, n in zip(chats, lengths, strict=True)
    ]
    for i, out in enumerate(expected):
        assert pd[i] == colo[i] == (out.text, len(out.token_ids)), chats[i]
    wait_idle("pd", 2)
    # One node: the router's channels from the decode replica (and the colocated app's
    # ingress's from its LLMServer) are sockets.
    for deployment, app in (("DecodeServer", "pd"), ("LLMServer", "colo")):
        (stats,) = replica_stats(deployment, app, 1).values()
        opened = stats["step_channels_opened"]
        assert opened["socket"] >= 1 and opened["messages"] == 0, (deployment, opened)


def test_streaming_n2_seeded_equals_offline(pd_server, offline):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=5)
    whole = client(pd_server, "/pd").completions.create(**kwargs, n=2)
    streamed = {0: "", 1: ""}
    for chunk in client(pd_server, "/pd").completions.create(**kwargs, n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10)
    expected = [c.text for c in offline.generate("Once upon a time", params)[0].outputs]
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == expected
    assert [streamed[0], streamed[1]] == expected
    assert whole.usage.completion_tokens == 20
    wait_idle("pd", 2)


def test_prompt_logprobs_come_from_the_prefill_replica(pd_server, offline):
    body = dict(model=MODEL, prompt=QUESTIONS[1], max_tokens=6, temperature=0)
    extra = {"extra_body": {"prompt_logprobs": 1}}
    pd = client(pd_server, "/pd").completions.create(**body, **extra).choices[0]
    colo = client(pd_server, "/colo").completions.create(**body, **extra).choices[0]
    expected = offline.generate(
        QUESTIONS[1], SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1)
    )[0]
    assert pd.text == colo.text == expected.outputs[0].text

    def logprob_maps(choice) -> list[dict[int, float]]:  # noqa: ANN001
        entries = choice.model_dump()["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(expected.prompt_token_ids)
        return [{int(k): v["logprob"] for k, v in e.items()} for e in entries[1:]]

    for served in (logprob_maps(pd), logprob_maps(colo)):
        for got, want in zip(served, expected.prompt_logprobs[1:], strict=True):
            assert got == pytest.approx(want, abs=1e-4)
    wait_idle("pd", 2)


def test_bad_parameters_are_400_through_the_router(pd_server):
    url = f"{pd_server}/pd/v1/completions"
    too_long = {"model": MODEL, "prompt": [5] * MAX_MODEL_LEN, "max_tokens": 1}
    assert httpx.post(url, json=too_long, timeout=30).status_code == 400
    bad_temp = {"model": MODEL, "prompt": "Hi", "temperature": -1}
    response = httpx.post(url, json=bad_temp, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
    one = {"model": MODEL, "prompt": [5] * (MAX_MODEL_LEN - 1), "max_tokens": 1}
    assert httpx.post(url, json=one, timeout=120).status_code == 200
    wait_idle("pd", 2)


def test_prefix_affinity_keeps_shared_system_prompts_on_one_replica(pd_server, offline):
    """Requests sharing a system prompt go to the prefill replica that cached it, so every
    request after the first of its group hits the whole shared prefix (full blocks)."""
    metrics_url = f"{pd_server}/pd/metrics"
    before = httpx.get(metrics_url, timeout=30).text
    pd = client(pd_server, "/pd")
    tokenizer = offline.get_tokenizer()
    expected_hits = 0
    for system in SYSTEM_PROMPTS:
        shared = shared_prefix_len(tokenizer, system, QUESTIONS)
        expected_hits += (len(QUESTIONS) - 1) * (shared // 16) * 16
        for question in QUESTIONS:
            pd.chat.completions.create(
                model=MODEL,
                messages=[
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
                temperature=0,
                max_tokens=2,
            )
    wait_idle("pd", 2)
    after = httpx.get(metrics_url, timeout=30).text
    hits = metric(after, "vllm:prefix_cache_hits_total") - metric(
        before, "vllm:prefix_cache_hits_total"
    )
    queries = metric(after, "vllm:prefix_cache_queries_total") - metric(
        before, "vllm:prefix_cache_queries_total"
    )
    print(f"prefix cache: {hits:.0f} of {queries:.0f} prompt tokens hit (>= {expected_hits})")
    assert hits >= expected_hits > 0


def shared_prefix_len(tokenizer, system: str, questions: list[str]) -> int:  # noqa: ANN001
    """How many leading chat-template tokens the chats (system + each question) share."""
    ids = [
        tokenizer.encode_chat(
            [{"role": "system", "content": system}, {"role": "user", "content": q}]
        )
        for q in questions
    ]
    n = 0
    while all(len(x) > n and x[n] == ids[0][n] for x in ids):
        n += 1
    return n


def test_kv_transfer_metrics_are_exported(pd_server):
    pd = client(pd_server, "/pd")
    pd.completions.create(model=MODEL, prompt="The sea is", max_tokens=4, temperature=0)
    text = httpx.get(f"{pd_server}/pd/metrics", timeout=30).text
    assert metric(text, "neuron:kv_transfer_seconds_count") > 0
    assert metric(text, "neuron:kv_transfer_bytes_total") > 0
    assert metric(text, "neuron:kv_exports_total") >= metric(text, "neuron:kv_imports_total") > 0
    assert re.search(r'neuron:kv_transfer_bytes_total\{[^}]*transport="nixl"', text)
    assert metric(text, "neuron:kv_transfer_failures_total") == 0
    wait_idle("pd", 2)


# -- failures -----------------------------------------------------------------------------


def _open_stream(url: str, body: dict, num_events: int):
    """Starts an SSE stream and returns (response context, line iterator) after a few events."""
    ctx = httpx.stream("POST", url, json=body, timeout=120)
    response = ctx.__enter__()
    lines = response.iter_lines()
    got = 0
    while got < num_events:
        if next(lines).startswith("data: "):
            got += 1
    return ctx, lines


def test_client_disconnect_mid_decode_frees_every_replica(pd_server):
    """Two streams at once, so their tokens travel over step channels (decode -> PD router
    -> ingress): the one whose client leaves is aborted, the other runs to its end."""
    url = f"{pd_server}/pd/v1/completions"
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story.",
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    ctx, _ = _open_stream(url, body, 4)
    other, lines = _open_stream(url, {**body, "max_tokens": 120}, 4)
    try:
        decode = replica_stats("DecodeServer", "pd", 1)
        assert next(iter(decode.values()))["num_running"] == 2
        ctx.__exit__(None, None, None)
        events = [line for line in lines if line.startswith("data: ")]
    finally:
        other.__exit__(None, None, None)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    wait_idle("pd", 2)


def test_client_disconnect_while_prefilling_frees_every_replica(pd_server):
    url = f"{pd_server}/pd/v1/completions"
    prompt = [5 + (i % 100) for i in range(900)]  # ~1 s of prefill
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 50, "stream": True}
    # The ingress answers once the first token exists: the client leaves during the prefill.
    with (
        pytest.raises(httpx.ReadTimeout),
        httpx.stream("POST", url, json=body, timeout=0.3) as response,
    ):
        for _ in response.iter_lines():
            pass
    wait_idle("pd", 2)


def tiny_pd_args(model_path: Path, **disaggregation):  # noqa: ANN201 - app.builder.BuildArgs
    """A disaggregated app over the tiny random-weight Llama, served as "tiny"."""
    from app.builder import BuildArgs

    return BuildArgs(
        mode="disaggregated",
        model=str(model_path),
        served_model_name="tiny",
        max_model_len=MAX_MODEL_LEN,
        embedding_model=None,
        engine_args={"num_kv_blocks": 256},
        disaggregation=disaggregation,
    )


@pytest.fixture(scope="module")
def fault_server(serve_cluster, tiny_llama_path, tmp_path_factory):
    from app.builder import build_openai_app

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    marker = tmp_path_factory.mktemp("faults") / "die-once"
    small = {"ray_actor_options": {"num_cpus": 0.05}}
    env = {
        "ray_actor_options": {
            "num_cpus": 0.05,
            "runtime_env": {"env_vars": {DIE_MARKER_ENV: str(marker)}},
        }
    }
    app = build_openai_app(
        tiny_pd_args(tiny_llama_path, kv_hold_timeout_s=3, kv_read_layer_wise=True),
        llm_engine_cls=DieOnceEngine,
        prefill_options={"num_replicas": 2, **env},
        decode_options={**small, "health_check_period_s": 1, "health_check_timeout_s": 5},
        ingress_options=small,
    )
    serve.run(app, name="pdfault", route_prefix="/pdfault")
    try:
        yield serve_cluster, marker
    finally:
        serve.delete("pdfault")


@pytest.fixture(scope="module")
def tiny_offline(tiny_llama_path) -> LLM:
    return LLM(model=str(tiny_llama_path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=256)


def test_prefill_replica_dying_mid_call_is_retried_on_another(fault_server, tiny_offline):
    base, marker = fault_server
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0}
    url = f"{base}/pdfault/v1/completions"
    assert httpx.post(url, json=body, timeout=60).status_code == 200
    marker.write_text("die")
    response = httpx.post(url, json=body, timeout=120)
    assert not marker.exists(), "no prefill replica took the marked request"
    assert response.status_code == 200, response.text
    expected = tiny_offline.generate(
        {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=12)
    )[0].outputs[0]
    assert response.json()["choices"][0]["text"] == expected.text
    # Serve replaces the dead replica; the app serves again on two prefill replicas.
    deadline = time.monotonic() + 90
    while True:
        try:
            replica_stats("PrefillServer", "pdfault", 2)
            break
        except Exception:  # noqa: BLE001 - the replacement is still starting
            assert time.monotonic() < deadline, "the dead prefill replica was not replaced"
            time.sleep(1)
    wait_idle("pdfault", 2)


def test_decode_replica_killed_mid_stream_migrates_its_streams(fault_server):
    """The PD router resumes both streams on the replacement decode replica
    (router/migration.py): no error event, each runs to its length."""
    base, _ = fault_server
    _kill_decode_mid_stream(base, "pdfault", 2)


def _kill_decode_mid_stream(base: str, app: str, num_prefill: int) -> None:
    """Two streams of a short prompt, their decode replica killed mid-stream: both end with
    their full length and no error event, and the app serves again afterwards."""
    url = f"{base}/{app}/v1/completions"
    body = {
        "model": "tiny",
        "prompt": [5, 6],
        "max_tokens": 800,
        "ignore_eos": True,
        "stream": True,
    }
    # Two streams at once: their tokens travel over step channels, which the kill ends.
    streams = [_open_stream(url, body, 3) for _ in range(2)]
    try:
        from ray.serve._private.common import DeploymentID, ReplicaID

        ((replica_id, stats),) = replica_stats("DecodeServer", app, 1).items()
        # Their tokens come over a step channel (the router's, or with direct_decode the
        # ingress's), a socket on this one node.
        assert stats["step_channels_opened"]["socket"] >= 1, stats["step_channels_opened"]
        name = ReplicaID(replica_id, DeploymentID("DecodeServer", app)).to_full_id_str()
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        endings = [[line for line in lines if line.startswith("data: ")] for _, lines in streams]
    finally:
        for ctx, _ in streams:
            ctx.__exit__(None, None, None)
    for events in endings:
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(event[6:]) for event in events[:-1]]
        assert not any("error" in chunk for chunk in chunks), chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 120
    short = {"model": "tiny", "prompt": [5, 6], "max_tokens": 3}
    while True:
        response = httpx.post(url, json=short, timeout=60)
        if response.status_code == 200:
            break
        assert time.monotonic() < deadline, f"decode not restarted: {response.text}"
        time.sleep(1)
    assert response.json()["usage"]["completion_tokens"] == 3
    wait_idle(app, num_prefill)


def _prefill_directly(app: str, request_id: str, prompt: list[int], max_tokens: int):  # noqa: ANN202
    """A PrefillResult straight from a prefill replica (no router, so no decode call)."""
    from deployments.protocol import GenerateRequest

    handle = serve.get_deployment_handle("PrefillServer", app_name=app)
    sampling = {"temperature": 0.0, "max_tokens": max_tokens, "detokenize": False}
    return handle.prefill.remote(GenerateRequest(request_id, prompt, sampling)).result(timeout_s=60)


def test_blocks_nobody_reads_are_freed_at_the_hold_timeout(fault_server):
    """Prefills whose request never reaches a decode replica (the client left in between)
    hold their blocks on the prefill replica only until kv_hold_timeout_s (3 s here)."""
    prompt = list(range(5, 45))
    results = [_prefill_directly("pdfault", f"strand-{i}", prompt, 5) for i in range(2)]
    assert all(r.handoff.ticket.transport == "nixl" for r in results)
    assert all(len(r.handoff.block_ids) == 3 and r.handoff.generator_state is None for r in results)
    prefill = replica_stats("PrefillServer", "pdfault", 2).values()
    assert sum(s["num_kv_handoffs_held"] for s in prefill) >= 1
    assert sum(s["num_kv_blocks_held"] for s in prefill) >= 3
    wait_idle("pdfault", 2, timeout_s=30)


def test_prefill_replica_dying_after_the_export_is_recomputed(fault_server, tiny_offline):
    """The KV's owner dies between the handoff and the decode replica's read: the decode
    replica cannot load its agent or read its blocks, recomputes, and ends idle."""
    from ray.serve._private.common import DeploymentID, ReplicaID

    from deployments.protocol import DecodeRequest

    base, _ = fault_server
    prompt = [5 + (3 * i) % 200 for i in range(50)]
    result = _prefill_directly("pdfault", "orphan", prompt, 10)
    name = ReplicaID(result.replica_id, DeploymentID("PrefillServer", "pdfault")).to_full_id_str()
    actor = ray.get_actor(name, namespace="serve")
    pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))
    ray.kill(actor, no_restart=True)
    # ray.kill returns before the process has gone: the read must come after it has.
    deadline = time.monotonic() + 30
    while _process_alive(pid):
        assert time.monotonic() < deadline, "the killed prefill replica's process lives on"
        time.sleep(0.1)
    decode = serve.get_deployment_handle("DecodeServer", app_name="pdfault").options(stream=True)
    sampling = {"temperature": 0.0, "max_tokens": 10, "detokenize": False}
    steps = list(decode.generate.remote(DecodeRequest("orphan", prompt, sampling, result.handoff)))
    tokens = result.handoff.output_token_ids + [
        t for s in steps for q in s.seqs for t in q.token_ids
    ]
    expected = tiny_offline.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10)
    )[0].outputs[0]
    assert tokens == expected.token_ids
    assert steps[0].kv_transfer.failed and steps[0].kv_transfer.transport == "nixl"
    deadline = time.monotonic() + 90
    while True:
        try:
            replica_stats("PrefillServer", "pdfault", 2)
            break
        except Exception:  # noqa: BLE001 - the replacement is still starting
            assert time.monotonic() < deadline, "the dead prefill replica was not replaced"
            time.sleep(1)
    wait_idle("pdfault", 2)


def _process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


# -- the object store transport ----------------------------------------------------------


@pytest.fixture(scope="module")
def object_store_server(serve_cluster, tiny_llama_path):
    from app.builder import build_openai_app

    small = {"ray_actor_options": {"num_cpus": 0.05}}
    app = build_openai_app(
        tiny_pd_args(
            tiny_llama_path,
            kv_transport="object_store",
            max_local_prefill_tokens=LOCAL_PREFILL_TOKENS,
        ),
        prefill_options=small,
        decode_options=small,
        ingress_options=small,
    )
    direct = build_openai_app(
        tiny_pd_args(
            tiny_llama_path,
            kv_transport="object_store",
            max_local_prefill_tokens=LOCAL_PREFILL_TOKENS,
            direct_decode=True,
        ),
        prefill_options=small,
        decode_options=small,
        ingress_options=small,
    )
    serve.run(app, name="pdobj", route_prefix="/pdobj")
    serve.run(direct, name="pddirect", route_prefix="/pddirect")
    try:
        yield serve_cluster
    finally:
        serve.delete("pdobj")
        serve.delete("pddirect")


@pytest.mark.parametrize("app", ["pdobj", "pddirect"])
def test_object_store_concurrent_mixed_greedy_equals_offline(
    object_store_server, tiny_offline, app
):
    """Prompts of 3, 14, 25, ... tokens: the first two prefilled at decode, the rest apart.
    In ``pddirect`` (direct_decode) the ingress sends the first two to the decode replica
    itself, so the PD router sees only the others."""
    prompts = [[5 + (7 * i + j) % 300 for j in range(3 + 11 * i)] for i in range(6)]
    lengths = [4 + 3 * i for i in range(len(prompts))]
    url = f"{object_store_server}/{app}/v1/completions"

    def ask(i: int) -> dict:
        body = {
            "model": "tiny",
            "prompt": prompts[i],
            "max_tokens": lengths[i],
            "temperature": 0,
            # Computed by whichever replica prefills: the prefill one, or decode.
            "prompt_logprobs": 1,
        }
        response = httpx.post(url, json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    local = router_total(app, "num_local_prefills")
    exports = _prefill_exports(app)
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(ask, range(len(prompts))))
    short = sum(len(p) <= LOCAL_PREFILL_TOKENS for p in prompts)
    assert 0 < short < len(prompts)
    # The long prompts were prefilled apart, the short ones by the decode replica: sent
    # there by the router, or in pddirect by the ingress.
    assert _prefill_exports(app) - exports == len(prompts) - short
    through_router = 0 if app == "pddirect" else short
    assert router_total(app, "num_local_prefills") - local == through_router
    for prompt, n, reply in zip(prompts, lengths, replies, strict=True):
        params = SamplingParams(temperature=0, max_tokens=n, prompt_logprobs=1)
        out = tiny_offline.generate({"prompt_token_ids": prompt}, params)[0]
        choice = reply["choices"][0]
        assert choice["text"] == out.outputs[0].text
        assert reply["usage"]["completion_tokens"] == len(out.outputs[0].token_ids)
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(prompt)
        for got, want in zip(entries[1:], out.prompt_logprobs[1:], strict=True):
            served = {int(token): entry["logprob"] for token, entry in got.items()}
            assert served == pytest.approx(want, abs=1e-4), len(prompt)
    text = httpx.get(f"{object_store_server}/{app}/metrics", timeout=30).text
    assert re.search(r'neuron:kv_transfer_bytes_total\{[^}]*transport="object_store"', text)
    assert metric(text, "neuron:kv_transfer_failures_total") == 0
    wait_idle(app, 1)


def _prefill_exports(app: str) -> int:
    """Prompts the app's one prefill replica has handed off to decode."""
    (stats,) = replica_stats("PrefillServer", app, 1).values()
    return stats["num_kv_exports"]


def test_direct_decode_stream_migrates_when_its_decode_replica_is_killed(object_store_server):
    """Short prompts in ``pddirect`` go from the ingress straight to the decode replica; the
    ingress resumes them on the replacement when that replica dies (router/migration.py)."""
    _kill_decode_mid_stream(object_store_server, "pddirect", 1)


# -- the KV fetch policy, on a DecodeServer outside Serve ------------------------------------


@ray.remote
def _lost_kv() -> None:
    raise RuntimeError("the prefill replica is gone")


@ray.remote
def _late_kv(seconds: float) -> None:
    time.sleep(seconds)


def _decode_server(model_path: Path, policy: str, timeout_s: float, transport: str):
    from deployments.decode import DecodeServer
    from deployments.kv_transport import KVTransportConfig

    return DecodeServer.func_or_class(
        {
            "model": str(model_path),
            "max_model_len": MAX_MODEL_LEN,
            "num_kv_blocks": 64,
            "num_threads": 1,  # outside a replica: no CPU allotment to size from
        },
        kv_fetch_timeout_s=timeout_s,
        on_kv_failure=policy,
        kv_transport=KVTransportConfig(transport),
    )


async def _decode_all(server, request) -> tuple[list[int], list]:
    tokens, transfers = [], []
    async for step in server.generate(request):
        transfers.append(step.kv_transfer)
        tokens.extend(t for s in step.seqs for t in s.token_ids)
    return tokens, transfers


@pytest.fixture
def broken_tickets(request, serve_cluster):
    """Tickets of the transport under test that cannot be redeemed, as functions of the decode
    replica's cache layout.

    object_store: an object whose task raised (its owner is gone), one not ready in time.
    nixl: the prefill agent's info whose owner died before anyone loaded it, info not ready
    in time, blocks that expire before they could be read.
    """
    from deployments.kv_transport import ObjectStoreTicket
    from deployments.nixl_transport import NixlTicket

    if request.param == "object_store":
        yield (
            "object_store",
            [
                lambda layout: ObjectStoreTicket(_lost_kv.remote()),
                lambda layout: ObjectStoreTicket(_late_kv.remote(30)),
            ],
        )
        return
    soon = time.time() + 60
    yield (
        "nixl",
        [
            lambda layout: NixlTicket("gone", _lost_kv.remote(), soon),
            lambda layout: NixlTicket("late", _late_kv.remote(30), soon),
            lambda layout: NixlTicket("expired", _late_kv.remote(0), time.time()),
        ],
    )


@pytest.mark.parametrize("broken_tickets", ["object_store", "nixl"], indirect=True)
def test_kv_fetch_failure_recomputes_or_fails_by_policy(
    broken_tickets, tiny_llama_path, tiny_offline
):
    from deployments.decode import KVFetchError
    from deployments.protocol import DecodeRequest
    from neuron_runtime.kv_transfer import KVHandoff, KVMetadata

    transport, tickets = broken_tickets
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=10)
    expected = tiny_offline.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    sampling = {"temperature": 0.0, "max_tokens": 10, "detokenize": False}
    metadata = KVMetadata.describe(tiny_offline.engine.config.model, prompt)

    def request(server, make_ticket) -> DecodeRequest:  # noqa: ANN001
        layout = server.engine.engine.kv_layout
        handoff = KVHandoff(metadata, expected[:1], None, "h", layout, (0,), make_ticket(layout))
        return DecodeRequest("r", prompt, sampling, handoff)

    recompute = _decode_server(tiny_llama_path, "recompute", 0.5, transport)
    for make_ticket in tickets:
        start = time.monotonic()
        tokens, transfers = asyncio.run(_decode_all(recompute, request(recompute, make_ticket)))
        assert tokens == expected[1:]  # the prompt was recomputed on the decode side
        assert transfers[0].failed and transfers[0].num_bytes == 0
        assert transfers[0].transport == transport
        assert transfers[0].seconds < 1.5, transfers[0]  # bounded by the fetch timeout
        assert time.monotonic() - start < 30
    fail = _decode_server(tiny_llama_path, "fail", 0.5, transport)
    with pytest.raises(KVFetchError):
        asyncio.run(_decode_all(fail, request(fail, tickets[-1])))
    for server in (recompute, fail):
        stats = server.engine.stats()
        assert stats.num_running == stats.num_kv_blocks_used == stats.num_unfinished_outputs == 0
        assert stats.num_kv_blocks_held == stats.num_kv_reads == 0
        server.engine.shutdown()
        server.transport.close()
