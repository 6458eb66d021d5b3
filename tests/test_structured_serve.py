"""Structured outputs, tool calling and /v1/responses over HTTP, with the official openai
client, on the default model: colocated, and disaggregated against colocated.

Outputs are checked with independent tools (``json`` + ``jsonschema``, ``re``), streamed
answers against non-streamed ones, disaggregated against colocated, and every engine
replica's stats against idle at the end.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray starts: bind to 127.0.0.1

import httpx
import pytest

pytestmark = pytest.mark.ray

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
jsonschema = pytest.importorskip("jsonschema")
from conftest import busy_engines  # noqa: E402
from ray import serve  # noqa: E402

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 1024
APP, PD_APP = "structured", "structured-pd"
WORDS = ["red", "green", "blue", "cat", "dog", "oak", "pine", "north", "south", "zero"]
KEYS = ["name", "id", "color", "size", "tags", "score", "owner", "city", "count", "flag"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def apps(serve_cluster):
    from app.builder import BuildArgs, build_openai_app

    small = {"ray_actor_options": {"num_cpus": 0.1}}
    colocated = build_openai_app(
        BuildArgs(
            max_model_len=MAX_MODEL_LEN,
            embedding_model=None,
            engine_args={"num_kv_blocks": 640},
        ),
        llm_options={"ray_actor_options": {"num_cpus": 1.0}},
        ingress_options=small,
    )
    disaggregated = build_openai_app(
        BuildArgs(
            mode="disaggregated",
            max_model_len=MAX_MODEL_LEN,
            embedding_model=None,
            engine_args={"num_kv_blocks": 128},
        ),
        prefill_options=small,
        decode_options=small,
        ingress_options=small,
    )
    serve.run(colocated, name=APP, route_prefix=f"/{APP}")
    serve.run(disaggregated, name=PD_APP, route_prefix=f"/{PD_APP}")
    try:
        yield serve_cluster
    finally:
        serve.delete(APP)
        serve.delete(PD_APP)


@pytest.fixture(scope="module")
def client(apps):
    return openai.OpenAI(base_url=f"{apps}/{APP}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def pd_client(apps):
    return openai.OpenAI(
        base_url=f"{apps}/{PD_APP}/v1", api_key="unused", max_retries=0, timeout=300
    )


def engine_stats(deployment: str, app: str) -> dict:
    handle = serve.get_deployment_handle(deployment, app_name=app)
    return handle.stats.remote().result(timeout_s=30)


def assert_idle(deployments=(("LLMServer", APP),), timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [engine_stats(name, app) for name, app in deployments]
        busy = busy_engines(stats) + [s for s in stats if s["num_grammar_states"]]
        if not busy:
            return
        assert time.monotonic() < deadline, f"not idle: {busy}"
        time.sleep(0.3)


# -- 50 generated JSON schemas at temperature 1.0 -------------------------------------------


def gen_value(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "array"]
    kind = rng.choice(kinds + (["object", "object"] if depth < 2 else []))
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 12)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 1000)}
    if kind == "number":
        # multipleOf bounds the digits too: this small model at temperature 1.0 can write a
        # fraction of free precision until max_tokens.
        low = rng.choice([-10.5, 0, 0.25, 3])
        high = low + rng.choice([1, 50, 999.5])
        step = rng.choice([0.25, 0.5, 0.1])
        return {"type": "number", "minimum": low, "maximum": high, "multipleOf": step}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 5))}
    if kind == "array":
        items = gen_value(rng, max(depth, 2))  # no objects inside arrays: keeps answers short
        return {"type": "array", "items": items, "minItems": 1, "maxItems": rng.randint(1, 3)}
    return gen_object(rng, depth + 1)


def gen_object(rng: random.Random, depth: int) -> dict:
    keys = rng.sample(KEYS, rng.randint(1, 4 if depth == 0 else 2))
    properties = {key: gen_value(rng, depth) for key in keys}
    required = rng.sample(keys, rng.randint(1, len(keys)))
    return {
        "type": "object",
        "properties": properties,
        "required": sorted(required, key=keys.index),
        "additionalProperties": False,
    }


def features(schema: dict, seen: set[str], depth: int = 0) -> set[str]:
    if schema.get("type") == "object":
        if depth:
            seen.add("nested object")
        if schema["required"]:
            seen.add("required")
        for value in schema["properties"].values():
            features(value, seen, depth + 1)
    elif schema.get("type") == "array":
        seen.add("array")
        features(schema["items"], seen, depth + 1)
    elif "enum" in schema:
        seen.add("enum")
    elif schema.get("type") in ("integer", "number"):
        seen.add(f"{schema['type']} with bounds")
    return seen


def test_fifty_generated_schemas_at_temperature_one_all_validate(client):
    rng = random.Random(2024)
    schemas = [gen_object(rng, 0) for _ in range(50)]
    seen: set[str] = set()
    for schema in schemas:
        features(schema, seen)
    assert seen >= {"nested object", "array", "enum", "required", "number with bounds"}

    def ask(i: int):
        schema = schemas[i]
        return client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": "Answer with one JSON object."},
                {"role": "user", "content": f"Fill in this JSON schema: {json.dumps(schema)}"},
            ],
            temperature=1.0,
            seed=i,
            max_tokens=240,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"schema_{i}", "schema": schema, "strict": True},
            },
        )

    with ThreadPoolExecutor(50) as pool:
        replies = list(pool.map(ask, range(50)))
    for schema, reply in zip(schemas, replies, strict=True):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert_idle()


# -- regex, choice, grammar, json_object; vLLM's field names --------------------------------


def test_regex_choice_grammar_and_json_object_through_every_field_name(client):
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
    cases = [
        ({"structured_outputs": {"regex": date}}, lambda t: re.fullmatch(date, t)),
        (
            {"guided_regex": r"[A-Z][a-z]+ [0-9]{1,2}"},
            lambda t: re.fullmatch(r"[A-Z][a-z]+ [0-9]{1,2}", t),
        ),
        (
            {"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}},
            lambda t: t in ("Paris", "Lyon", "Nice"),
        ),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        (
            {"guided_grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'},
            lambda t: re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", t),
        ),
        (
            {
                "guided_json": {
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}},
                    "required": ["ok"],
                    "additionalProperties": False,
                }
            },
            lambda t: isinstance(json.loads(t)["ok"], bool),
        ),
    ]
    for extra, check in cases:
        for temperature in (0.0, 1.0):
            reply = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Answer briefly."}],
                temperature=temperature,
                seed=3,
                max_tokens=40,
                extra_body=extra,
            )
            text = reply.choices[0].message.content
            assert reply.choices[0].finish_reason == "stop" and check(text), (extra, text)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": "Reply with a JSON object with the name and the age of a dog.",
            }
        ],
        temperature=1.0,
        seed=2,
        max_tokens=200,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    completion = client.completions.create(
        model=MODEL,
        prompt="The best colour is",
        max_tokens=8,
        n=3,
        temperature=1.0,
        seed=5,
        extra_body={"guided_choice": [" red", " green", " blue"]},
    )
    assert all(c.text in (" red", " green", " blue") for c in completion.choices)
    assert_idle()


def test_constrained_stream_equals_non_stream(client):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        temperature=0,
        max_tokens=80,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "cat", "schema": SCHEMAS["get_weather"]},
        },
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    jsonschema.validate(json.loads(whole), SCHEMAS["get_weather"])


# -- refusals -------------------------------------------------------------------------------


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/{APP}{path}", json=body, timeout=60)


def chat_body(**fields) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **fields,
    }


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                }
            ),
            "response_format.json_schema",
        ),
        (dict(response_format={"type": "json_schema"}), "response_format"),
        (dict(response_format={"type": "structural_tag"}), "response_format"),
        (dict(guided_regex="(unclosed"), "guided_regex"),
        (dict(guided_grammar="start: missing_rule"), "guided_grammar"),
        (dict(guided_json={"type": "string", "pattern": "(["}), "guided_json"),
        (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
        (dict(structured_outputs={"regex": "a", "backend": "xgrammar"}), "structured_outputs"),
        (dict(guided_regex="a", guided_choice=["a"]), "guided_choice"),
        (dict(guided_regex="a", ignore_eos=True), "ignore_eos"),
        (dict(guided_decoding_backend="xgrammar"), "guided_decoding_backend"),
        (
            dict(
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]
            ),
            "tools",
        ),
        (
            dict(tools=[ADD], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice",
        ),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[ADD], tool_choice="required", guided_regex="a"), "tool_choice"),
        (dict(functions=[{"name": "f"}]), "functions"),
        (dict(chat_template="{{ messages }}"), "chat_template"),
        (dict(store=True), "store"),
    ],
)
def test_unusable_constraints_and_unknown_fields_are_400_naming_the_field(apps, fields, param):
    reply = post(apps, "/v1/chat/completions", chat_body(**fields))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error


def test_too_large_grammar_is_refused_fast_and_the_server_keeps_serving(apps, client):
    start = time.monotonic()
    huge = {"enum": [f"value number {i}" for i in range(30_000)]}
    reply = post(apps, "/v1/chat/completions", chat_body(guided_json=huge))
    assert reply.status_code in (400, 413), reply.text
    assert time.monotonic() - start < 10
    ok = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, max_tokens=4, extra_body={"guided_choice": ["a"]}
    )
    assert ok.choices[0].message.content == "a"
    assert_idle()


# -- tools ----------------------------------------------------------------------------------


def check_calls(calls, allowed: list[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_tool_choice_always_parse(client):
    named = {"type": "function", "function": {"name": "add"}}
    for choice, allowed, finish in (
        ("required", ["get_weather", "add"], "tool_calls"),
        (named, ["add"], "stop"),
    ):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ASK_WEATHER,
            tools=TOOLS,
            tool_choice=choice,
            temperature=1.0,
            seed=7,
            n=4,
            max_tokens=120,
        )
        for c in reply.choices:
            assert c.finish_reason == finish and c.message.content is None
            check_calls(c.message.tool_calls, allowed)
    single = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=9,
        n=4,
        max_tokens=120,
    )
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)
    assert_idle()


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto"]
)
def test_streamed_tool_call_deltas_reassemble_to_the_whole_answer(client, choice):
    kwargs = dict(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice=choice,
        temperature=0,
        max_tokens=80,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id:
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (content or None) == whole.message.content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []
    ]
    assert finish == whole.finish_reason
    if choice != "auto":
        check_calls(whole.message.tool_calls, ["get_weather", "add"])


def test_tool_results_round_trip_into_the_prompt(apps, client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees"},
    ]
    tokens = post(apps, "/tokenize", {"model": MODEL, "messages": messages}).json()["tokens"]
    prompt = post(apps, "/detokenize", {"model": MODEL, "tokens": tokens}).json()["prompt"]
    # The template has no tool support: the call and its result are written in Hermes form.
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        in prompt
    )
    assert "<tool_response>\nSunny, 24 degrees\n</tool_response>" in prompt
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=16
    )
    assert reply.choices[0].message.content or reply.choices[0].message.tool_calls
    missing_id = post(
        apps, "/v1/chat/completions", chat_body(messages=[{"role": "tool", "content": "x"}])
    )
    assert missing_id.status_code == 400 and missing_id.json()["error"]["param"] == "messages"


# -- /v1/responses --------------------------------------------------------------------------


def test_responses_text_equals_chat_and_streams_its_events(client):
    kwargs = dict(
        model=MODEL,
        instructions="Be brief.",
        input="What is the capital of France?",
        temperature=0,
        max_output_tokens=16,
    )
    response = client.responses.create(**kwargs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": kwargs["input"]},
        ],
        temperature=0,
        max_tokens=16,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens > 0
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert (
        kinds[:2] == ["response.created", "response.in_progress"]
        and kinds[-1] == "response.completed"
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text == events[-1].response.output_text
    assert {
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.output_item.done",
    } <= set(kinds)


def test_responses_json_schema_and_function_tools(client):
    schema = SCHEMAS["get_weather"]
    response = client.responses.create(
        model=MODEL,
        input=[
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather in Rome as JSON."}],
            }
        ],
        text={
            "format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}
        },
        temperature=1.0,
        max_output_tokens=80,
    )
    jsonschema.validate(json.loads(response.output_text), schema)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    called = client.responses.create(
        model=MODEL,
        input="Weather in Rome?",
        tools=tools,
        tool_choice="required",
        temperature=0,
        max_output_tokens=80,
    )
    (item,) = [o for o in called.output if o.type == "function_call"]
    jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])
    events = list(
        client.responses.create(
            model=MODEL,
            input="Weather in Rome?",
            tools=tools,
            tool_choice="required",
            temperature=0,
            max_output_tokens=80,
            stream=True,
        )
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == item.arguments
    # The call and its output go back in as input items (stateless round trip).
    follow = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather in Rome?"},
            {
                "type": "function_call",
                "call_id": item.call_id,
                "name": item.name,
                "arguments": item.arguments,
            },
            {"type": "function_call_output", "call_id": item.call_id, "output": "Rain, 12 degrees"},
        ],
        tools=tools,
        temperature=0,
        max_output_tokens=12,
    )
    assert follow.status in ("completed", "incomplete")
    assert_idle()


@pytest.mark.parametrize(
    "fields, param",
    [
        (dict(previous_response_id="resp_1"), "previous_response_id"),
        (dict(store=True), "store"),
        (dict(tools=[{"type": "web_search"}]), "tools"),
        (
            dict(
                text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}
            ),
            "response_format.json_schema",
        ),
        (dict(input=[]), "input"),
        (dict(temperature=-1), "temperature"),
        (dict(model="other"), "model"),
    ],
)
def test_responses_refusals_name_the_field(apps, fields, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    reply = post(apps, "/v1/responses", body)
    assert reply.status_code in (400, 404), reply.text
    assert reply.json()["error"]["param"].startswith(param)


# -- disaggregated ---------------------------------------------------------------------------


def test_disaggregated_constrained_output_equals_colocated(client, pd_client):
    def ask(c, **extra):
        reply = c.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=60, **extra)
        return [
            (
                ch.message.content,
                [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []],
            )
            for ch in reply.choices
        ]

    cases = [
        dict(
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": SCHEMAS["get_weather"]},
            },
        ),
        dict(temperature=0, extra_body={"guided_regex": r"[A-Z][a-z]+, [0-9]{1,2} degrees"}),
        dict(
            temperature=0,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        ),
        # Seeded sampling, n=2: the decode side continues each grammar and generator.
        dict(
            temperature=1.0,
            seed=4,
            n=2,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": SCHEMAS["add"]},
            },
        ),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:
        colocated = list(pool.map(lambda kw: ask(client, **kw), cases))
        disaggregated = list(pool.map(lambda kw: ask(pd_client, **kw), cases))
    assert disaggregated == colocated
    jsonschema.validate(json.loads(colocated[0][0][0]), SCHEMAS["get_weather"])
    assert_idle((("PrefillServer", PD_APP), ("DecodeServer", PD_APP), ("LLMServer", APP)))
