"""``POST /v1/responses``, stateless: a Responses request becomes a chat request (the same
validation, template, tools and constraints), and the chat's output becomes a Response
object or the Responses API's stream of typed events.

Nothing is stored: ``previous_response_id``, ``store: true``, background mode and the
hosted tools are refused with a 400 naming the field, like every field not listed here.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from app.errors import OpenAIError
from app.generation import Generation
from app.protocol import ChatCompletionRequest, OpenAIModel
from app.tools import PlainParser, ToolCallParser, ToolSetup


class InputText(OpenAIModel):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text parts of earlier answers carry them


class InputImage(OpenAIModel):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] = "auto"


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | InputImage]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @field_validator("store")
    @classmethod
    def _stateless(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("this server keeps no responses: send store=false or leave it out")
        return value


def to_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that computes ``request`` (a 400 if it cannot be expressed)."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    items = (
        [MessageItem(role="user", content=request.input)]
        if isinstance(request.input, str)
        else request.input
    )
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _chat_content(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    chat: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "stream": request.stream,
        "parallel_tool_calls": request.parallel_tool_calls,
    }
    for name, value in (
        ("max_tokens", request.max_output_tokens),
        ("temperature", request.temperature),
        ("top_p", request.top_p),
        ("user", request.user),
    ):
        if value is not None:
            chat[name] = value
    if request.tools:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in request.tools
        ]
    choice = request.tool_choice
    if choice is not None:
        chat["tool_choice"] = (
            choice
            if isinstance(choice, str)
            else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif fmt.json_schema is None or fmt.name is None:
            raise OpenAIError(
                400, "text.format json_schema needs a name and a schema", param="text.format"
            )
        else:
            schema = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}
            if fmt.description is not None:
                schema["description"] = fmt.description
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise OpenAIError(400, f"input: {where}: {first.get('msg')}", param="input") from exc


def _chat_content(content: str | list[InputText | InputImage]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, InputText):
            parts.append({"type": "text", "text": part.text})
        else:
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
    return parts


# -- the answer -----------------------------------------------------------------------------


def response_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Chat usage -> the Responses API's names."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _base(request: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    fmt = request.text.format if request.text is not None else None
    choice: Any = request.tool_choice or "auto"
    if isinstance(choice, ToolChoiceFunction):
        choice = choice.model_dump()
    text_format = {"type": "text"}
    if fmt is not None:
        text_format = fmt.model_dump(by_alias=True, exclude_none=True)
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "in_progress",
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "parallel_tool_calls": request.parallel_tool_calls,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tool_choice": choice,
        "tools": [t.model_dump(exclude_none=True) for t in request.tools or []],
        "text": {"format": text_format},
        "store": False,
        "usage": None,
    }


def _finish(body: dict[str, Any], finish_reason: str | None) -> None:
    if finish_reason == "length":
        body["status"] = "incomplete"
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        body["status"] = "completed"


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}] if text else [],
    }


def _call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"].get("arguments", ""),
        "status": status,
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def response_object(
    request: ResponsesRequest,
    response_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    tools: ToolSetup | None,
    usage: dict[str, Any],
) -> dict[str, Any]:
    """The whole Response for a finished generation of ``text``."""
    parser = tools.new_parser() if tools is not None else PlainParser()
    parser.feed(text, final=True)
    content, calls = parser.message()
    body = _base(request, response_id, model)
    if content:
        body["output"].append(_message_item(_item_id("msg"), content, "completed"))
    for call in calls or []:
        body["output"].append(_call_item(_item_id("fc"), call, "completed"))
    _finish(body, finish_reason)
    body["usage"] = response_usage(usage)
    return body


class _EventWriter:
    """Responses stream events (``event: <type>`` + JSON data), numbered in order."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **data}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


async def response_events(
    request: ResponsesRequest,
    generation: Generation,
    tools: ToolSetup | None,
    response_id: str,
    model: str,
) -> AsyncIterator[str]:
    """The Responses stream: created, in_progress, per output item its added / delta /
    done events, then completed (or failed: every stream ends with one of the two)."""
    event = _EventWriter()
    body = _base(request, response_id, model)
    yield event("response.created", response=dict(body))
    yield event("response.in_progress", response=dict(body))
    parser: ToolCallParser = tools.new_parser() if tools is not None else PlainParser()
    output: list[dict[str, Any]] = body["output"]
    open_item: dict[str, Any] | None = None  # the item being streamed

    def close() -> list[str]:
        nonlocal open_item
        item, open_item = open_item, None
        if item is None:
            return []
        index = output.index(item)
        item["status"] = "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(event("response.output_text.done", **common, text=part["text"]))
            out.append(event("response.content_part.done", **common, part=part))
        else:
            out.append(
                event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
        out.append(event("response.output_item.done", output_index=index, item=item))
        return out

    try:
        finish_reason = None
        async for events in generation.events():
            for choice in events:
                final = choice.finish_reason is not None
                if final:
                    finish_reason = choice.finish_reason
                content, calls = parser.feed(choice.text, final)
                if content:
                    if open_item is None or open_item["type"] != "message":
                        for line in close():
                            yield line
                        open_item = _message_item(_item_id("msg"), "", "in_progress")
                        output.append(open_item)
                        index = len(output) - 1
                        yield event(
                            "response.output_item.added", output_index=index, item=open_item
                        )
                        part = {"type": "output_text", "text": "", "annotations": []}
                        open_item["content"].append(part)
                        yield event(
                            "response.content_part.added",
                            item_id=open_item["id"],
                            output_index=index,
                            content_index=0,
                            part=part,
                        )
                    open_item["content"][0]["text"] += content
                    yield event(
                        "response.output_text.delta",
                        item_id=open_item["id"],
                        output_index=output.index(open_item),
                        content_index=0,
                        delta=content,
                    )
                for call in calls:
                    if call.id is not None:
                        for line in close():
                            yield line
                        open_item = _call_item(
                            _item_id("fc"), parser.calls[call.index], "in_progress"
                        )
                        open_item["arguments"] = ""
                        output.append(open_item)
                        yield event(
                            "response.output_item.added",
                            output_index=len(output) - 1,
                            item=open_item,
                        )
                    assert open_item is not None
                    open_item["arguments"] += call.arguments
                    yield event(
                        "response.function_call_arguments.delta",
                        item_id=open_item["id"],
                        output_index=output.index(open_item),
                        delta=call.arguments,
                    )
        for line in close():
            yield line
        _finish(body, finish_reason)
        body["usage"] = response_usage(generation.usage())
        yield event("response.completed", response=body)
    except Exception as exc:  # noqa: BLE001 - the stream must end with one final event
        body["status"] = "failed"
        body["error"] = {"code": "server_error", "message": f"generation failed: {exc}"[:500]}
        yield event("response.failed", response=body)
