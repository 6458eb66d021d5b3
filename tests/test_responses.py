"""/v1/responses without a model: a Responses request as the chat request that computes it,
and a finished generation as a Response object (the HTTP path is in
tests/test_structured_serve.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from app.errors import OpenAIError
from app.protocol import ChatCompletionRequest
from app.responses import ResponsesRequest, response_object, response_usage, to_chat_request
from app.tools import tool_setup

ADD = {
    "type": "function",
    "name": "add",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}
IMAGE = "data:image/png;base64,iVBORw0KGgo="


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def test_a_string_input_with_instructions_becomes_system_and_user_turns():
    chat = to_chat_request(
        request(instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9)
    )
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert (chat.max_tokens, chat.temperature, chat.top_p) == (7, 0.5, 0.9)


def test_input_items_become_messages_tool_calls_and_tool_results():
    chat = to_chat_request(
        request(
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": IMAGE},
                    ],
                },
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "3"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Done.", "annotations": []}],
                },
            ],
            tools=[ADD],
            tool_choice={"type": "function", "name": "add"},
            text={"format": {"type": "json_object"}},
        )
    )
    user, calls, result, answer = chat.messages
    assert user.content == [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": IMAGE}},
    ]
    assert [c.id for c in calls.tool_calls] == ["c1", "c2"] and calls.content is None
    assert (result.role, result.tool_call_id, result.content) == ("tool", "c1", "3")
    assert answer.content == [{"type": "text", "text": "Done."}]
    assert chat.tools[0].function.name == "add"
    assert chat.tool_choice.function.name == "add"
    assert chat.response_format.type == "json_object"


def test_a_json_schema_format_becomes_response_format():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    chat = to_chat_request(
        request(text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    )
    assert chat.response_format.json_schema.json_schema == schema
    with pytest.raises(OpenAIError) as err:
        to_chat_request(request(text={"format": {"type": "json_schema", "name": "x"}}))
    assert err.value.param == "text.format"


@pytest.mark.parametrize(
    "fields",
    [
        dict(previous_response_id="resp_1"),
        dict(store=True),
        dict(background=True),
        dict(tools=[{"type": "web_search"}]),
        dict(input=[{"type": "input_file", "file_id": "f"}]),
        dict(input=[]),
        dict(reasoning={"effort": "high"}),
    ],
)
def test_fields_a_stateless_server_cannot_honour_are_refused(fields):
    with pytest.raises(ValidationError):
        request(**fields)


def test_response_object_splits_text_and_tool_calls_and_reports_length():
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    plain = response_object(request(), "resp_1", "m", "Hello there", "stop", None, usage)
    assert plain["status"] == "completed" and plain["object"] == "response"
    (message,) = plain["output"]
    assert message["content"][0] == {
        "type": "output_text",
        "text": "Hello there",
        "annotations": [],
    }
    assert plain["usage"] == response_usage(usage)
    assert plain["usage"]["input_tokens"] == 5 and plain["usage"]["output_tokens"] == 3
    cut = response_object(request(), "resp_2", "m", "Hel", "length", None, usage)
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}

    tools_request = request(tools=[ADD], tool_choice="required")
    chat = to_chat_request(tools_request)
    assert isinstance(chat, ChatCompletionRequest)
    setup = tool_setup(chat, None, "llama")
    text = '[{"name":"add","arguments":{"a":1,"b":2}}]'
    called = response_object(tools_request, "resp_3", "m", text, "stop", setup, usage)
    (call,) = called["output"]
    assert call["type"] == "function_call" and call["name"] == "add"
    assert json.loads(call["arguments"]) == {"a": 1, "b": 2} and call["call_id"].startswith("call_")
