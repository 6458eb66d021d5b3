"""Property-based fuzzing (hypothesis) of the request models (app/protocol.py) over HTTP.

Requests are drawn around the edges of every field of the OpenAI request models: oversized
``logit_bias``, ``stop``, ``tools`` and token-id lists, deep JSON, invalid UTF-8 and lone
surrogates, token ids out of the vocabulary, NaN/Infinity and overflowing numbers, and ``n`` x
``max_tokens`` products larger than the decode replica's KV cache. They go to the disaggregated
app (conftest ``fuzz_app``: encode -> prefill -> decode on the tiny LLaVA, plus embeddings).
Each answer must be a clean 200 or a 400 with the OpenAI error body whose ``param`` names a
field of the request; never a 5xx, never a hang (every request has a deadline). Afterwards the
engines are alive (health, a greedy request) and every replica is back at its idle baseline.
Each test prints how many examples it ran and how they were answered.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
hypothesis = pytest.importorskip("hypothesis")
import httpx  # noqa: E402
from chaos.harness import is_error_body, wait_baseline  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MODEL = "tiny"
VOCAB = 49153  # SmolLM2's 49152 tokens plus tiny-llava's <image>
REQUEST_DEADLINE_S = 60.0
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)

# -- strategies ---------------------------------------------------------------------------------

# Token ids: mostly valid, often at or past the edges of the vocabulary and of int64.
token_ids = st.one_of(
    st.integers(0, VOCAB - 1),
    st.sampled_from([-1, VOCAB, VOCAB + 1, 2**31, 2**63, -(2**63), 10**30]),
    st.integers(-(2**70), 2**70),
)
# Numbers as JSON text: finite, huge, NaN and the infinities (Python's json writes NaN and
# Infinity literals; 1e999 overflows to inf when parsed).
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 2, 1e999, -1e999, 10**30]),
    st.integers(-10, 10),
)
# Text with NUL, lone surrogates (escaped in the JSON), emoji and text spelling special tokens.
texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "\x00", "\ud800", "a\udfffb", "\U0001f600", "<|im_end|>", "<image>"]),
)
small_lists = {"max_size": 8}

logit_bias = st.one_of(
    st.dictionaries(st.one_of(token_ids.map(str), texts), numbers, max_size=8),
    # Oversized: the whole vocabulary and past it.
    st.integers(1, 3 * VOCAB).map(lambda n: {str(i): 1.0 for i in range(n)}),
)
stop = st.one_of(
    texts,
    st.lists(texts, **small_lists),
    st.integers(17, 2000).map(lambda n: [f"s{i}" for i in range(n)]),  # past the cap of 16
    st.integers(1, 200_000).map(lambda n: ["x" * n]),  # one long stop string
)
id_lists = st.one_of(
    st.lists(token_ids, **small_lists),
    st.integers(1000, 20_000).map(lambda n: list(range(n))),  # oversized lists
)


def tool(name: str, parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


tools = st.one_of(
    st.lists(
        st.builds(
            tool,
            st.from_regex(r"[a-zA-Z0-9_-]{1,8}", fullmatch=True),
            st.one_of(
                st.none(), st.just({"type": "object"}), st.integers(1, 60).map(nested_schema)
            ),
        ),
        max_size=4,
    ),
    st.integers(129, 1000).map(lambda n: [tool(f"f{i}", None) for i in range(n)]),  # past 128
)

sampling_fields = {
    "n": st.one_of(st.integers(1, 3), st.integers(-1, 10**6)),
    "max_tokens": st.one_of(st.integers(1, 8), st.integers(-5, 10**9)),
    "min_tokens": st.one_of(st.integers(0, 4), st.integers(-5, 10**9)),
    "temperature": numbers,
    "top_p": numbers,
    "top_k": st.one_of(st.integers(-3, 100), token_ids),
    "min_p": numbers,
    "seed": st.one_of(st.integers(0, 100), st.integers(-(2**70), 2**70)),
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "repetition_penalty": numbers,
    "logit_bias": logit_bias,
    "stop": stop,
    "stop_token_ids": id_lists,
    "allowed_token_ids": id_lists,
    "bad_words": st.lists(texts, **small_lists),
    "ignore_eos": st.booleans(),
    "prompt_logprobs": st.one_of(st.integers(0, 3), st.integers(-5, 10**6)),
    "stream": st.booleans(),
}


@st.composite
def completion_bodies(draw: st.DrawFn) -> dict[str, Any]:
    prompt = draw(
        st.one_of(
            texts.filter(bool),
            st.lists(token_ids, min_size=0, max_size=12),
            st.lists(st.lists(token_ids, min_size=1, max_size=6), min_size=0, max_size=20),
            st.integers(200, 3000).map(lambda n: [5] * n),  # past max_model_len
        )
    )
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    body.update(draw(st.fixed_dictionaries({}, optional=sampling_fields)))
    body.update(draw(st.fixed_dictionaries({}, optional={"logprobs": st.integers(-2, 30)})))
    return body


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    content = draw(
        st.one_of(
            texts,
            st.lists(
                st.one_of(
                    st.builds(lambda t: {"type": "text", "text": t}, texts),
                    st.just(
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
                    ),
                    st.just({"type": "input_audio", "input_audio": {}}),
                ),
                max_size=3,
            ),
        )
    )
    role = draw(st.sampled_from(["user", "user", "system", "assistant", "tool", "robot"]))
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": role, "content": content}],
        "max_tokens": 4,
    }
    body.update(draw(st.fixed_dictionaries({}, optional=sampling_fields)))
    optional = {
        "tools": tools,
        "tool_choice": st.sampled_from(["none", "auto", "required", "bogus"]),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(-2, 30),
        "max_completion_tokens": st.one_of(st.integers(1, 8), st.integers(-2, 10**9)),
        "response_format": st.sampled_from(
            [
                {"type": "json_object"},
                {"type": "text"},
                {"type": "json_schema"},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": nested_schema(40)}},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}},
            ]
        ),
    }
    body.update(draw(st.fixed_dictionaries({}, optional=optional)))
    return body


def deep(depth: int, kind: str) -> str:
    return ("[" * depth + "]" * depth) if kind == "list" else ('{"a":' * depth + "1" + "}" * depth)


@st.composite
def raw_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """(path, body bytes) that no JSON encoder of a well-behaved client would write."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings"]))
    kind = draw(st.sampled_from(["deep", "binary", "bad-utf8", "literal", "truncated"]))
    if kind == "deep":
        depth = draw(st.integers(10, 100_000))
        field = "prompt" if path == "/v1/completions" else "input"
        if path == "/v1/chat/completions":
            field = "messages"
        inner = deep(depth, draw(st.sampled_from(["list", "dict"])))
        return path, f'{{"model": "{MODEL}", "{field}": {inner}}}'.encode()
    if kind == "binary":
        return path, draw(st.binary(max_size=200))
    if kind == "bad-utf8":
        junk = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80"]))
        return path, b'{"model": "tiny", "prompt": "a' + junk + b'", "input": "b' + junk + b'"}'
    if kind == "literal":
        literal = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "1" * 400]))
        name = draw(st.sampled_from(["temperature", "top_p", "max_tokens", "n", "seed"]))
        return path, f'{{"model": "{MODEL}", "prompt": "a", "{name}": {literal}}}'.encode()
    text = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2})
    return path, text[: draw(st.integers(0, len(text) - 1))].encode()


# -- checks -------------------------------------------------------------------------------------


class Tally:
    def __init__(self, name: str) -> None:
        self.name = name
        self.counts: dict[int, int] = {}

    def add(self, status: int) -> None:
        self.counts[status] = self.counts.get(status, 0) + 1

    def line(self) -> str:
        total = sum(self.counts.values())
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items()))
        return f"hypothesis {self.name}: {total} examples ({answers})"


def post(base: str, path: str, body: dict[str, Any] | None = None, raw: bytes | None = None):
    """The status and the parsed answer (for a stream: its events) of one request."""
    content = raw if raw is not None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    with httpx.stream(
        "POST", base + path, content=content, headers=headers, timeout=REQUEST_DEADLINE_S
    ) as response:
        response.read()
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return response.status_code, [
            line[6:] for line in response.text.splitlines() if line.startswith("data: ")
        ]
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


def root_field(param: str) -> str:
    return re.split(r"[.\[]", param, maxsplit=1)[0]


def check_answer(status: int, answer: Any, body: dict[str, Any] | None) -> None:
    """A clean 200, a 400 with the OpenAI error body naming a field of ``body``, or a 413
    with the error body for one past max_body_bytes."""
    if status == 413:
        assert is_error_body(answer), answer
        return
    assert status in (200, 400), (status, answer)
    if status == 400:
        assert is_error_body(answer), answer
        param = answer["error"]["param"]
        if body is not None:
            assert param is not None, f"no param in {answer}"
            assert root_field(param) in body, (param, sorted(body))
        return
    if isinstance(answer, list):  # a stream: [DONE] last, no error event
        assert answer and answer[-1] == "[DONE]", answer[-3:]
        for event in answer[:-1]:
            assert not is_error_body(json.loads(event)), event
        return
    assert isinstance(answer, dict), answer
    assert answer.get("choices") or answer.get("data") or "tokens" in answer or "prompt" in answer


# -- tests --------------------------------------------------------------------------------------


def _report(capsys, tally: Tally) -> None:
    with capsys.disabled():
        print(f"\n{tally.line()}")


def test_completion_requests(fuzz_app, capsys) -> None:
    tally = Tally("completions")

    @settings(FUZZ, max_examples=60)
    @given(body=completion_bodies())
    def run(body: dict[str, Any]) -> None:
        status, answer = post(fuzz_app, "/v1/completions", body)
        tally.add(status)
        check_answer(status, answer, body)

    run()
    _report(capsys, tally)
    wait_baseline("fuzz")


def test_chat_requests(fuzz_app, capsys) -> None:
    tally = Tally("chat completions")

    @settings(FUZZ, max_examples=50)
    @given(body=chat_bodies())
    def run(body: dict[str, Any]) -> None:
        status, answer = post(fuzz_app, "/v1/chat/completions", body)
        tally.add(status)
        check_answer(status, answer, body)

    run()
    _report(capsys, tally)
    wait_baseline("fuzz")


def test_embedding_and_token_requests(fuzz_app, capsys) -> None:
    tally = Tally("embeddings, tokenize, detokenize")
    inputs = st.one_of(
        texts,
        st.lists(texts, max_size=6),
        st.lists(token_ids, max_size=8),
        st.lists(st.lists(token_ids, max_size=4), max_size=4),
        st.integers(129, 400).map(lambda n: ["a"] * n),  # past max_embedding_inputs
        st.integers(600, 3000).map(lambda n: [101] * n),  # past the embedding model's length
    )
    requests = st.one_of(
        st.builds(
            lambda x, d: ("/v1/embeddings", {"input": x, **d}),
            inputs,
            st.fixed_dictionaries(
                {},
                optional={
                    "dimensions": st.integers(-2, 1000),
                    "encoding_format": st.sampled_from(["float", "base64", "hex"]),
                },
            ),
        ),
        st.builds(lambda t: ("/detokenize", {"tokens": t}), st.lists(token_ids, max_size=8)),
        st.builds(lambda p: ("/tokenize", {"prompt": p}), texts),
    )

    @settings(FUZZ, max_examples=40)
    @given(request=requests)
    def run(request: tuple[str, dict[str, Any]]) -> None:
        path, body = request
        status, answer = post(fuzz_app, path, body)
        tally.add(status)
        check_answer(status, answer, body)

    run()
    _report(capsys, tally)


def test_hostile_bodies(fuzz_app, capsys) -> None:
    """Deep JSON, bytes that are not UTF-8, NaN/Infinity/overflowing literals, cut bodies:
    400 (the field named where the JSON parsed), never a 5xx."""
    tally = Tally("raw bodies")

    @settings(FUZZ, max_examples=40)
    @given(request=raw_bodies())
    def run(request: tuple[str, bytes]) -> None:
        path, raw = request
        status, answer = post(fuzz_app, path, raw=raw)
        tally.add(status)
        assert status in (200, 400, 413), (status, answer)
        if status != 200:
            assert is_error_body(answer), answer

    run()
    _report(capsys, tally)


def test_n_times_max_tokens_beyond_the_kv_cache(fuzz_app) -> None:
    """n x max_tokens twice the decode replica's KV cache (fuzz_app: 64 blocks of 16 tokens,
    a 256-token context): sequences are preempted and recomputed as needed, never stuck;
    the answer is the whole n x max_tokens. One request: it is the slowest of the suite."""
    n, prompt_len = 8, 8
    max_tokens = 256 - prompt_len
    body = {
        "model": MODEL,
        "prompt": [5 + i for i in range(prompt_len)],
        "n": n,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 1,
    }
    status, answer = post(fuzz_app, "/v1/completions", body)
    check_answer(status, answer, body)
    assert answer["usage"]["completion_tokens"] == n * max_tokens
    wait_baseline("fuzz")


def test_engines_alive_and_idle_afterwards(fuzz_app) -> None:
    assert httpx.get(f"{fuzz_app}/health", timeout=30).status_code == 200
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    status, answer = post(fuzz_app, "/v1/completions", body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 3
    wait_baseline("fuzz")
