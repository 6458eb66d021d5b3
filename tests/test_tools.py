"""Tool calling without a model: request checks, the grammar's schema, the conversation for
templates without tool support, and each family's parser, whole and streamed in pieces."""

from __future__ import annotations

import json
import random

import pytest

from app.errors import OpenAIError
from app.protocol import ChatCompletionRequest
from app.tools import PARSERS, calls_schema, family_parser, hermes_conversation, tool_setup

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
HI = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": HI, **fields})


def run(parser_name: str, text: str, pieces: int | None = None, **kw):
    """(content, calls) of ``text`` fed whole, or in random pieces (streamed)."""
    parser = PARSERS[parser_name](**kw)
    if pieces is None:
        parser.feed(text, final=True)
        return parser.message()
    rng = random.Random(pieces)
    cuts = sorted(rng.sample(range(1, len(text)), min(pieces, len(text) - 1)))
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    content, calls = "", {}
    for i, chunk in enumerate(chunks):
        text_delta, deltas = parser.feed(chunk, final=i == len(chunks) - 1)
        content += text_delta
        for d in deltas:
            if d.id is not None:
                assert d.index not in calls and d.name
                calls[d.index] = {"name": d.name, "arguments": ""}
            calls[d.index]["arguments"] += d.arguments
    return content or None, [calls[i] for i in sorted(calls)] or None


def names_and_args(calls):
    return [(c["function"]["name"] if "function" in c else c["name"], _args(c)) for c in calls]


def _args(call):
    return json.loads(call["function"]["arguments"] if "function" in call else call["arguments"])


CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})],
    ),
    (
        "hermes",
        "No tools: a < b and <tool_ is not a tag.",
        "No tools: a < b and <tool_ is not a tag.",
        [],
    ),
    (
        "hermes",
        "<tool_call>not json</tool_call> then text",
        "<tool_call>not json</tool_call> then text",
        [],
    ),
    # The model stopped before writing the closing tag.
    (
        "hermes",
        '<tool_call>{"name": "add", "arguments": {"a": 5, "b": 6}}',
        None,
        [("add", {"a": 5, "b": 6})],
    ),
    (
        "llama3_json",
        '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", '
        '"parameters": {"city": "Oslo"}}',
        None,
        [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})],
    ),
    ("llama3_json", "The answer is 3.", "The answer is 3.", []),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 7, "b": 8}}]',
        None,
        [("add", {"a": 7, "b": 8})],
    ),
    (
        "mistral",
        ' [{"name": "add", "arguments": {"a": 7, "b": 8}}]',
        None,
        [("add", {"a": 7, "b": 8})],
    ),
    ("mistral", "[1] is a citation.", "[1] is a citation.", []),
    (
        "required",
        '[{"name":"add","arguments":{"a":1,"b":2}},{"name":"get_weather","arguments":{"city":"Rome"}}]',
        None,
        [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})],
    ),
]


@pytest.mark.parametrize("parser, text, content, expected", CASES)
def test_parsers_whole_and_streamed_agree(parser, text, content, expected):
    whole_content, whole_calls = run(parser, text)
    assert whole_content == content
    assert names_and_args(whole_calls or []) == expected
    for seed in (1, 3, 7, 50):
        streamed_content, streamed_calls = run(parser, text, pieces=seed)
        assert streamed_content == whole_content
        assert [(c["name"], c["arguments"]) for c in streamed_calls or []] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole_calls or []
        ]


def test_named_parser_streams_argument_fragments_and_parallel_false_keeps_one_call():
    text = '{"a":1,"b":22}'
    content, calls = run("named", text, pieces=5, named="add")
    assert content is None and calls == [{"name": "add", "arguments": text}]
    content, calls = run("required", CASES[-1][1], parallel=False)
    assert names_and_args(calls) == [("add", {"a": 1, "b": 2})]


def test_required_schema_accepts_exactly_calls_of_the_declared_tools():
    schema = calls_schema(chat(tools=[WEATHER, ADD]), parallel=True)
    jsonschema.validate([{"name": "add", "arguments": {"a": 1, "b": 2}}], schema)
    for bad in (
        [],
        [{"name": "sub", "arguments": {}}],
        [{"name": "add", "arguments": {"a": "x", "b": 2}}],
        [{"name": "add"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = calls_schema(chat(tools=[ADD]), parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "arguments": {"a": 1, "b": 2}}] * 2, single)


def test_tool_setup_modes_and_refusals():
    chatml = "{% for m in messages %}{{ m.content }}{% endfor %}"
    qwen = "{% if tools %}<tool_call>{% endif %}"
    auto = tool_setup(chat(tools=[WEATHER]), chatml, "llama")
    assert (auto.mode, auto.parser, auto.inject, auto.constraint) == ("auto", "hermes", True, None)
    assert tool_setup(chat(tools=[WEATHER]), qwen, "qwen2").parser == "hermes"
    named = tool_setup(
        chat(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}}),
        qwen,
        "qwen2",
    )
    assert named.parser == "named" and named.constraint.params.json == ADD["function"]["parameters"]
    assert named.constraint.param == "tools[1].function.parameters"
    required = tool_setup(chat(tools=[ADD], tool_choice="required"), qwen, "qwen2")
    assert required.constraint.params.json["type"] == "array"
    assert tool_setup(chat(tools=[ADD], tool_choice="none"), qwen, "qwen2").tools == []
    assert tool_setup(chat(), qwen, "qwen2") is None
    refusals = [
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[ADD, ADD]), "tools"),
        (
            dict(tools=[ADD], tool_choice={"type": "function", "function": {"name": "x"}}),
            "tool_choice",
        ),
        (
            dict(tools=[ADD], tool_choice="required", response_format={"type": "json_object"}),
            "tool_choice",
        ),
    ]
    for fields, param in refusals:
        with pytest.raises(OpenAIError) as err:
            tool_setup(chat(**fields), qwen, "qwen2")
        assert err.value.status_code == 400 and err.value.param == param


def test_family_parser_follows_the_template_then_the_model_type():
    assert family_parser("... <tool_call> ...", "llama") == "hermes"
    assert family_parser("... [TOOL_CALLS] ...", "llama") == "mistral"
    assert family_parser("... <|python_tag|> ...", "qwen2") == "llama3_json"
    assert family_parser("{{ tools }}", "llama") == "llama3_json"
    assert family_parser("{{ tools }}", "mistral") == "mistral"
    assert family_parser("{{ tools }}", "qwen3") == "hermes"


def test_conversation_for_templates_without_tools_round_trips_in_hermes_form():
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]
    out = hermes_conversation(conversation, [WEATHER])
    assert out[0]["role"] == "system" and json.dumps(WEATHER) in out[0]["content"]
    # The assistant turn reads back as the call it made.
    content, calls = run("hermes", out[2]["content"])
    assert content is None and names_and_args(calls) == [("get_weather", {"city": "Paris"})]
    assert out[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in out)


def test_templates_that_read_tools_receive_them_and_calls_with_object_arguments(
    default_model_path,
):
    from app.protocol import ChatMessage
    from app.tools import template_message
    from neuron_runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(default_model_path)
    # A template of the Qwen kind: tools listed up front, calls written from their objects.
    tokenizer.hf_tokenizer.chat_template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}"
        "{% endfor %}"
    )
    messages = [
        ChatMessage(role="user", content="Add 1 and 2."),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 1}'},
                    }
                ],
            }
        ),
        ChatMessage(role="tool", content="3", tool_call_id="c"),
    ]
    conversation = [template_message(m, m.content or "") for m in messages]
    ids = tokenizer.encode_chat(conversation, [WEATHER, ADD])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text == '[get_weather][add]<user>Add 1 and 2.<assistant>{"a": 1}<tool>3'
