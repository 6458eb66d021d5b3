"""The whole application on a local Ray cluster, driven over HTTP by the openai client.

One session-scoped cluster holds two applications: ``main`` (the real default model and the
embedding model) and ``fake`` (a scripted engine behind max_ongoing_requests=1 and
max_queued_requests=1, an API key, for backpressure, error injection and auth).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray starts: bind to 127.0.0.1

import httpx
import pytest

pytestmark = pytest.mark.ray

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from neuron_runtime.outputs import CompletionOutput, RequestOutput  # noqa: E402

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 1024
FAIL_TOKEN = 666  # a fake-engine prompt starting with this token fails after two tokens
DIE_TOKEN = 667  # a DyingEngine prompt starting with this token kills that engine for good
API_KEY = "test-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class FakeEngine:
    """Emits token 28 every ``step_s`` (20 ms); no model. Shaped like AsyncEngine for LLMServer."""

    step_s = 0.02

    def __init__(self) -> None:
        self.running = 0

    @classmethod
    def from_engine_args(cls, args):  # noqa: ANN001, ANN206
        return cls()

    async def generate(self, prompt, params, request_id, kind, **kwargs):  # noqa: ANN001, ANN003, ANN201
        ids = prompt["prompt_token_ids"]
        now = time.monotonic()
        metrics = {"arrival_time": now, "first_scheduled_time": now}
        self.running += 1
        try:
            for step in range(params.max_tokens):
                await asyncio.sleep(self.step_s)
                if ids[0] == FAIL_TOKEN and step == 2:
                    raise RuntimeError("injected engine failure")
                last = step == params.max_tokens - 1
                finish = "length" if last else None
                outputs = [CompletionOutput(0, "", [28], finish)]
                yield RequestOutput(request_id, None, ids, outputs, last, metrics=metrics)
        finally:
            self.running -= 1

    def stats(self):  # noqa: ANN201
        from neuron_runtime.engine import EngineStats

        return EngineStats(self.running, 0, 8, 0, 8, 0.0, 0, 0, 0, self.running)

    def check_health(self, stall_timeout_s: float = 30.0) -> None:
        pass


class DyingEngine(FakeEngine):
    """A FakeEngine whose loop "dies" on a DIE_TOKEN prompt: every later call raises."""

    dead = False

    async def generate(self, prompt, params, request_id, kind, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if prompt["prompt_token_ids"][0] == DIE_TOKEN:
            self.dead = True
        self.check_health()
        async for out in super().generate(prompt, params, request_id, kind, **kwargs):
            yield out

    def check_health(self, stall_timeout_s: float = 30.0) -> None:
        if self.dead:
            raise RuntimeError("engine loop is not running: injected death")


class SlowEngine(FakeEngine):
    """A FakeEngine emitting one token every 100 ms, for streams that outlive a redeploy."""

    step_s = 0.1


@pytest.fixture(scope="session")
def server(serve_cluster):
    from app.builder import BuildArgs, build_openai_app

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engine_args = {"num_kv_blocks": 256}
    # Both apps' streams leave the ingress batched (router/streams.py coalesce): streamed
    # outputs, client disconnects, error events and drains below go through it.
    main = build_openai_app(
        BuildArgs(
            max_model_len=MAX_MODEL_LEN, engine_args=engine_args, stream_batching_interval_ms=20
        ),
        llm_options={"ray_actor_options": {"num_cpus": 1.0}},
        ingress_options={"ray_actor_options": {"num_cpus": 0.25}},
    )
    fake = build_openai_app(
        BuildArgs(
            max_model_len=MAX_MODEL_LEN,
            embedding_model=None,
            api_key=API_KEY,
            stream_batching_interval_ms=20,
        ),
        llm_engine_cls=FakeEngine,
        llm_options={
            "max_ongoing_requests": 1,
            "max_queued_requests": 1,
            "ray_actor_options": {"num_cpus": 0.1},
        },
        ingress_options={"ray_actor_options": {"num_cpus": 0.1}},
    )
    serve.run(main, name="main", route_prefix="/")
    serve.run(fake, name="fake", route_prefix="/fake")
    try:
        yield serve_cluster
    finally:
        serve.delete("main")
        serve.delete("fake")


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def offline_llm():
    from neuron_runtime import LLM

    return LLM(model=MODEL, max_model_len=MAX_MODEL_LEN, num_kv_blocks=128)


def llm_stats() -> dict:
    handle = serve.get_deployment_handle("LLMServer", app_name="main")
    return handle.stats.remote().result(timeout_s=30)


# -- the happy paths ----------------------------------------------------------------------


def test_chat_greedy_equals_offline_llm(client, offline_llm):
    from neuron_runtime import SamplingParams

    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=12
    )
    (expected,) = offline_llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12))
    choice = reply.choices[0]
    assert choice.message.content == expected.outputs[0].text
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_bf16_app_serves_the_offline_bf16_engines_tokens(server):
    """``engine_args: {dtype: bfloat16}`` in a served app: its streamed chat is the offline
    engine's with the same dtype, token for token."""
    from app.builder import BuildArgs, build_openai_app
    from neuron_runtime import LLM, SamplingParams
    from neuron_runtime.backends.cpu_kernels import kernels

    fused = kernels()
    if fused is None or not fused.has_bf16:
        pytest.skip("this CPU has no AVX512_BF16")
    app = build_openai_app(
        BuildArgs(
            max_model_len=MAX_MODEL_LEN,
            embedding_model=None,
            engine_args={"num_kv_blocks": 64, "dtype": "bfloat16"},
        ),
        llm_options={"ray_actor_options": {"num_cpus": 0.5}},
        ingress_options={"ray_actor_options": {"num_cpus": 0.1}},
    )
    serve.run(app, name="bf16", route_prefix="/bf16")
    try:
        bf16 = openai.OpenAI(base_url=f"{server}/bf16/v1", api_key="unused", max_retries=0)
        stream = bf16.chat.completions.create(
            model=MODEL, messages=QUESTION, temperature=0, max_tokens=24, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        serve.delete("bf16")
    offline = LLM(model=MODEL, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, dtype="bfloat16")
    (expected,) = offline.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24))
    assert text == expected.outputs[0].text and "Paris" in text


def test_chat_stream_equals_non_stream_and_reports_usage(client):
    kwargs = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_concurrent_streams_equal_offline_llm(client, offline_llm):
    """Streams at once share step channels (one message per engine step for all of them):
    each still gets exactly the offline engine's greedy text, and the engine ends idle."""
    from concurrent.futures import ThreadPoolExecutor

    from neuron_runtime import SamplingParams

    prompts = [f"Count from {i} to {i + 20}:" for i in range(1, 7)]
    lengths = [10 + 3 * i for i in range(len(prompts))]

    def stream(i: int) -> str:
        chunks = client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=lengths[i], temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)

    baseline = llm_stats()
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(stream, range(len(prompts))))
    expected = [
        offline_llm.generate(p, SamplingParams(temperature=0, max_tokens=n))[0].outputs[0].text
        for p, n in zip(prompts, lengths, strict=True)
    ]
    assert got == expected
    wait_engine_idle(baseline)
    # The ingress and the LLMServer share this node: every channel between them is a socket.
    opened = llm_stats()["step_channels_opened"]
    assert opened["socket"] >= 1 and opened["messages"] == 0, opened


def test_completion_n2_seeds_reproducible_and_streaming(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=7)
    first = client.completions.create(**kwargs, n=2)
    again = client.completions.create(**kwargs, n=2)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert first.usage.completion_tokens == 16
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(**kwargs, n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == [c.text for c in first.choices]


def test_logprobs_chat_and_completion(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
    comp = client.completions.create(
        model=MODEL, prompt="The sky is", temperature=0, max_tokens=4, logprobs=2
    )
    logprobs = comp.choices[0].logprobs
    assert len(logprobs.tokens) == 4 and all(len(t) == 2 for t in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == comp.choices[0].text


def test_prompt_logprobs_equal_transformers(server, client):
    """vLLM's prompt_logprobs extension against a fresh transformers forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    from neuron_runtime.model_store import resolve_model

    prompt = "The quick brown fox jumps over the lazy dog because"
    comp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    comp_entries = comp.choices[0].model_dump()["prompt_logprobs"]
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    chat_entries = chat.model_dump()["prompt_logprobs"]

    path = resolve_model(MODEL)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    for entries, ids, num_top in (
        (comp_entries, _tokenize(server, prompt=prompt), 2),
        (chat_entries, _tokenize(server, messages=QUESTION), 0),
    ):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        assert len(entries) == len(ids) and entries[0] is None
        for i in range(1, len(ids)):
            entry = {int(k): v for k, v in entries[i].items()}
            expected = logprobs[i - 1]
            assert entry[ids[i]]["logprob"] == pytest.approx(float(expected[ids[i]]), abs=1e-3)
            top = torch.topk(expected, 2).indices.tolist()[:num_top]
            ranked = sorted(
                (t for t in entry if entry[t]["rank"] is not None), key=lambda t: entry[t]["rank"]
            )
            assert ranked == top, i
    response = httpx.post(
        f"{server}/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "stream": True, "prompt_logprobs": 1},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt_logprobs"


def _tokenize(server: str, **body) -> list[int]:
    response = httpx.post(f"{server}/tokenize", json={"model": MODEL, **body}, timeout=30)
    return response.json()["tokens"]


def test_bad_words_and_allowed_tokens_equal_offline_llm(client, offline_llm):
    from neuron_runtime import SamplingParams

    kwargs = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=10)
    extra = {"bad_words": ["Paris"], "allowed_token_ids": None}
    reply = client.chat.completions.create(**kwargs, extra_body=extra)
    params = SamplingParams(temperature=0, max_tokens=10, bad_words=["Paris"])
    (expected,) = offline_llm.chat(QUESTION, params)
    assert reply.choices[0].message.content == expected.outputs[0].text
    assert "Paris" not in expected.outputs[0].text
    allowed = expected.outputs[0].token_ids[:3]
    reply = client.chat.completions.create(**kwargs, extra_body={"allowed_token_ids": allowed})
    params = SamplingParams(temperature=0, max_tokens=10, allowed_token_ids=allowed)
    (expected,) = offline_llm.chat(QUESTION, params)
    assert reply.choices[0].message.content == expected.outputs[0].text


def test_stop_string_cuts_text(client):
    kwargs = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = "Paris"
    assert stop in full
    reply = client.chat.completions.create(**kwargs, stop=[stop])
    assert reply.choices[0].message.content == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kwargs, stop=[stop], stream=True)
        if c.choices
    )
    assert streamed == full[: full.index(stop)]


def test_embeddings(client):
    reply = client.embeddings.create(
        model="all-minilm-l6-v2", input=["A cat sits on the mat.", "Stock markets fell."]
    )
    vectors = [d.embedding for d in reply.data]
    assert len(vectors) == 2 and len(vectors[0]) == 384
    assert sum(x * x for x in vectors[0]) == pytest.approx(1.0, abs=1e-4)
    assert reply.usage.prompt_tokens > 0


def test_models_tokenize_health_metrics_request_id(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL, "all-minilm-l6-v2"]
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{server}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"].endswith("Hello world")
    assert httpx.get(f"{server}/health").status_code == 200
    response = httpx.get(f"{server}/v1/models", headers={"X-Request-Id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    metrics = httpx.get(f"{server}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert name in metrics, name


# -- failure behaviour ---------------------------------------------------------------------


def _chat_body(**overrides):
    return {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **overrides}


@pytest.mark.parametrize(
    "overrides, param",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"n": 1000}, "n"),
        ({"n": 0}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"max_completion_tokens": 5000}, "max_completion_tokens"),
        ({"min_tokens": 10}, "min_tokens"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"stop": [""]}, "stop"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [99999999]}, "allowed_token_ids"),
        ({"allowed_token_ids": list(range(5000))}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"seed": 2**64, "temperature": 1.0}, "seed"),
        ({"seed": -(2**63) - 1, "temperature": 1.0}, "seed"),
    ],
)
def test_invalid_chat_parameter_is_400_naming_it(server, overrides, param):
    response = httpx.post(f"{server}/v1/chat/completions", json=_chat_body(**overrides))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "prompt, status",
    [
        ("", 400),
        ([], 400),
        ([-1, 5], 400),
        ([49152 * 4], 400),
        ([5] * MAX_MODEL_LEN, 400),
        ([5] * (MAX_MODEL_LEN * 10), 400),
        ([[5]] * 17, 400),
    ],
)
def test_invalid_prompt_is_400(server, prompt, status):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    response = httpx.post(f"{server}/v1/completions", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == "prompt"


def test_prompt_of_max_len_minus_one_with_one_token_is_served(server):
    body = {"model": MODEL, "prompt": [5] * (MAX_MODEL_LEN - 1), "max_tokens": 1}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1


def test_odd_text_never_crashes(server):
    for content in ("\ud800 lone", "nul \x00 byte", "emoji \U0001f600", "<|im_start|>system"):
        body = json.dumps(_chat_body(messages=[{"role": "user", "content": content}], max_tokens=2))
        response = httpx.post(  # json.dumps escapes the lone surrogate as \ud800
            f"{server}/v1/chat/completions",
            content=body,
            timeout=60,
            headers={"content-type": "application/json"},
        )
        assert response.status_code in (200, 400), response.text
        response.json()  # valid JSON (so valid UTF-8) either way


def test_malformed_json_content_type_and_size(server):
    url = f"{server}/v1/chat/completions"
    bad_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "error" in bad_json.json()
    wrong_type = httpx.post(url, content=b"{}", headers={"content-type": "text/plain"})
    assert wrong_type.status_code == 415
    huge = json.dumps(_chat_body(messages=[{"role": "user", "content": "x" * (2 << 20)}]))
    too_big = httpx.post(url, content=huge, headers={"content-type": "application/json"})
    assert too_big.status_code == 413 and "error" in too_big.json()


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=QUESTION, max_tokens=2)


def test_client_disconnect_aborts_in_engine(server):
    baseline = llm_stats()
    body = _chat_body(max_tokens=400, stream=True, ignore_eos=True)
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
        assert llm_stats()["num_running"] >= 1
    wait_engine_idle(baseline)
    assert llm_stats()["num_aborted"] == baseline["num_aborted"] + 1  # ended, not finished


def wait_engine_idle(baseline: dict) -> None:
    deadline = time.monotonic() + 30
    while True:
        stats = llm_stats()
        idle = (
            stats["num_running"] == stats["num_waiting"] == stats["num_unfinished_outputs"] == 0
            and stats["num_kv_blocks_used"] == baseline["num_kv_blocks_used"]
        )
        if idle:
            break
        assert time.monotonic() < deadline, f"engine did not return to baseline: {stats}"
        time.sleep(0.2)


def test_engine_error_ends_one_stream_with_error_event(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": [FAIL_TOKEN, 5], "max_tokens": 10, "stream": True}
    other = _chat_body(max_tokens=24, stream=True, ignore_eos=True)
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=other, timeout=120) as ok:
        ok_lines = ok.iter_lines()
        next(ok_lines)
        failing = httpx.post(f"{server}/fake/v1/completions", json=body, headers=headers)
        events = [line for line in failing.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert "injected engine failure" in json.loads(events[-2][6:])["error"]["message"]
        rest = [line for line in ok_lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in "".join(rest)


async def test_backpressure_is_fast_503(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{server}/fake/v1/completions"
    long = {"model": MODEL, "prompt": [5, 6], "max_tokens": 60, "stream": True}
    short = {"model": MODEL, "prompt": [5, 6], "max_tokens": 3}
    async with httpx.AsyncClient(headers=headers, timeout=60) as http:
        async with http.stream("POST", url, json=long) as busy:
            lines = busy.aiter_lines()
            await anext(lines)  # running: the one ongoing slot is taken
            queued = asyncio.create_task(http.post(url, json=short))  # the one queue slot
            await asyncio.sleep(0.5)
            start = time.monotonic()
            rejected = await http.post(url, json=short)
            elapsed = time.monotonic() - start
            assert rejected.status_code == 503, rejected.text
            assert rejected.json()["error"]["type"] == "service_unavailable"
            assert rejected.headers["retry-after"] == "1"
            assert elapsed < 1.5
            assert [line async for line in lines if line.startswith("data: ")][-1] == (
                "data: [DONE]"
            )
        assert (await queued).status_code == 200  # admitted requests finish


def test_api_key_required_when_configured(server):
    url = f"{server}/fake/v1/models"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.get(f"{server}/fake/health").status_code == 200


# -- replica lifecycle (RELIABILITY cases 19 and 20) ----------------------------------------
# Each test deploys its own small app (zero CPUs: the session apps use 1.95 of the 2) under
# its own name and route prefix, and deletes it at the end; `main` and `fake` are untouched.


def _side_app(engine_cls: type, stall_timeout_s: float = 30.0, **llm_options):
    from app.builder import BuildArgs, build_openai_app

    args = BuildArgs(
        max_model_len=MAX_MODEL_LEN, embedding_model=None, health_stall_timeout_s=stall_timeout_s
    )
    return build_openai_app(
        args,
        llm_engine_cls=engine_cls,
        llm_options={"ray_actor_options": {"num_cpus": 0}, **llm_options},
        ingress_options={"ray_actor_options": {"num_cpus": 0}},
    )


def _llm_replica_id(app_name: str) -> str:
    handle = serve.get_deployment_handle("LLMServer", app_name=app_name)
    return handle.stats.remote().result(timeout_s=10)["replica_id"]


def test_dead_engine_fails_health_and_replica_is_replaced(server):
    """Case 19: once the engine is dead, check_health raises; with a 1 s period Serve marks
    the replica unhealthy after 3 failed checks, replaces it, and serving continues on a
    new replica (a different LLMServer replica id)."""
    name, prefix = "dying", "/dying"
    serve.run(
        _side_app(DyingEngine, health_check_period_s=1, health_check_timeout_s=2),
        name=name,
        route_prefix=prefix,
    )
    try:
        url = f"{server}{prefix}/v1/completions"
        body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 3}
        assert httpx.post(url, json=body, timeout=30).status_code == 200
        old_replica = _llm_replica_id(name)
        killed = httpx.post(url, json={**body, "prompt": [DIE_TOKEN, 5]}, timeout=30)
        assert killed.status_code >= 500, killed.text
        unhealthy = httpx.get(f"{server}{prefix}/health", timeout=30)
        assert unhealthy.status_code == 503 and "injected death" in unhealthy.text
        start = time.monotonic()
        deadline = start + 30
        while True:
            response = httpx.post(url, json=body, timeout=30)
            if response.status_code == 200 and _llm_replica_id(name) != old_replica:
                break
            assert time.monotonic() < deadline, f"replica not replaced: {response.text}"
            time.sleep(0.5)
        assert response.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"{server}{prefix}/health", timeout=30).status_code == 200
        print(f"served by a new replica {time.monotonic() - start:.1f}s after the death")
    finally:
        serve.delete(name)


def test_rolling_update_drains_in_flight_stream(server):
    """Case 20: redeploy the app while a ~4 s stream is in flight; it completes on the old
    replicas, then a new request is served by a new LLMServer replica.

    Every ``serve.run`` gives unversioned deployments a new random version, so both the
    ingress and LLMServer replicas are replaced. With the default max_surge_percent=0 and
    one replica, Serve stops the old replicas first: they drain (the in-flight stream ends
    normally with finish_reason, usage and ``data: [DONE]``, no error event), and only then
    does the app serve again once the new replicas have started (~20 s on 2 CPUs, during
    which this app has no replica). ``serve.run`` returns after the stream has ended.
    """
    import threading

    name, prefix = "rolling", "/rolling"
    options = {"graceful_shutdown_timeout_s": 20, "graceful_shutdown_wait_loop_s": 0.5}
    serve.run(_side_app(SlowEngine, **options), name=name, route_prefix=prefix)
    try:
        url = f"{server}{prefix}/v1/completions"
        old_replica = _llm_replica_id(name)
        body = {
            "model": MODEL,
            "prompt": [5, 6],
            "max_tokens": 40,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = threading.Event()
        events: list[str] = []
        done_at: list[float] = []

        def stream() -> None:
            with httpx.stream("POST", url, json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        started.set()
            done_at.append(time.monotonic())
            started.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert started.wait(30) and not done_at
        serve.run(
            _side_app(SlowEngine, stall_timeout_s=31.0, **options), name=name, route_prefix=prefix
        )
        redeployed_at = time.monotonic()
        reader.join(60)
        assert not reader.is_alive(), "in-flight stream hung across the redeploy"
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert all("error" not in c for c in chunks), chunks[-1]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
        assert chunks[-1]["usage"]["completion_tokens"] == 40  # the whole stream arrived
        short = {"model": MODEL, "prompt": [5, 6], "max_tokens": 3}
        after = httpx.post(url, json=short, timeout=30)
        assert after.status_code == 200, after.text
        assert _llm_replica_id(name) != old_replica
        print(f"stream ended {redeployed_at - done_at[0]:.1f}s before serve.run returned")
    finally:
        serve.delete(name)
