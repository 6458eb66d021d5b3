"""Tool calling: ``tools`` and ``tool_choice`` -> chat template inputs, a grammar, and the
tool calls parsed out of the model's text.

- ``tool_choice: "none"``: the template does not see the tools; the output is plain text.
- ``"auto"``: the template gets ``tools``; the model's own tool-call format is parsed, with
  a parser per model family (Hermes ``<tool_call>`` JSON for Qwen2.5/Qwen3 and ChatML
  models, Llama 3 JSON, Mistral ``[TOOL_CALLS]``). A template that never reads ``tools``
  gets the tools in a system message in the Hermes format instead, and that parser.
- ``"required"`` and a named function: a grammar built from the tools' schemas forces the
  output: a JSON array of ``{"name", "arguments"}`` objects (required) or the named
  function's arguments object. These always parse.

Every parser works on the growing text and only ever extends what it already returned, so
the streamed deltas add up to the non-streamed message.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from app.errors import OpenAIError
from app.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from app.sampling import Constraint
from neuron_runtime.structured_output import StructuredOutputsParams

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"


@dataclass(frozen=True)
class ToolSetup:
    """What a chat request's tools mean for the prompt, the sampling and the answer."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]  # OpenAI function tools, for the chat template
    parser: str  # "hermes" | "llama3_json" | "mistral" | "required" | "named" | "none"
    named: str | None = None
    parallel: bool = True
    constraint: Constraint | None = None
    # The template never reads ``tools``: they are described in a system message instead.
    inject: bool = False

    def new_parser(self) -> ToolCallParser:
        return PARSERS[self.parser](self.parallel, self.named)

    def finish_reason(self, reason: str | None, num_calls: int) -> str | None:
        """OpenAI's finish reason: "tool_calls" when tools were called (a named choice ends
        with "stop", as OpenAI's does)."""
        if reason == "stop" and num_calls and self.mode != "named":
            return "tool_calls"
        return reason


def tool_setup(
    request: ChatCompletionRequest, chat_template: str | None, model_type: str
) -> ToolSetup | None:
    """Checks the request's tool fields; None when it has no tools."""
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice != "none":
            raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    tools = [t.model_dump(exclude_none=True) for t in request.tools]
    names = [t.function.name for t in request.tools]
    if len(set(names)) != len(names):
        raise OpenAIError(400, "tool function names must be unique", param="tools")
    mode: str | NamedToolChoice = "auto" if choice is None else choice
    named = None
    if isinstance(mode, NamedToolChoice):
        named = mode.function.name
        if named not in names:
            raise OpenAIError(
                400, f"tool_choice names {named!r}, which is not among the tools", "tool_choice"
            )
        mode = "named"
    if mode != "none" and _output_constrained(request):
        raise OpenAIError(
            400,
            "response_format and the other output constraints apply only with tool_choice "
            "'none': a tool call cannot also follow them",
            # The field the client sent: tool_choice, else the tools its default applies to.
            param="tool_choice" if choice is not None else "tools",
        )
    supports_tools = chat_template is not None and "tools" in chat_template
    constraint = None
    if mode == "named":
        index = names.index(str(named))
        schema = request.tools[index].function.parameters or {"type": "object"}
        constraint = Constraint(
            StructuredOutputsParams(json=schema, disable_any_whitespace=True),
            f"tools[{index}].function.parameters",
        )
    elif mode == "required":
        constraint = Constraint(
            StructuredOutputsParams(
                json=calls_schema(request, request.parallel_tool_calls),
                disable_any_whitespace=True,
            ),
            "tools",
        )
    parser = {"none": "none", "named": "named", "required": "required"}.get(mode) or (
        family_parser(chat_template or "", model_type) if supports_tools else "hermes"
    )
    return ToolSetup(
        mode=mode,
        tools=tools if mode != "none" else [],
        parser=parser,
        named=named,
        parallel=request.parallel_tool_calls,
        constraint=constraint,
        inject=mode != "none" and not supports_tools,
    )


def _output_constrained(request: ChatCompletionRequest) -> bool:
    fmt = request.response_format
    return (fmt is not None and fmt.type != "text") or any(
        getattr(request, name) is not None
        for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice")
        + ("guided_grammar",)
    )


def calls_schema(request: ChatCompletionRequest, parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each ``{"name": <a tool>, "arguments": <its parameters>}``."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "arguments": tool.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in request.tools or []
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": variants}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def family_parser(chat_template: str, model_type: str) -> str:
    """The tool-call format a template (or else the model family) uses."""
    if HERMES_OPEN in chat_template:
        return "hermes"
    if MISTRAL_TAG in chat_template or model_type.startswith(("mistral", "mixtral")):
        return "mistral"
    if PYTHON_TAG in chat_template or "ipython" in chat_template or model_type == "llama":
        return "llama3_json"
    return "hermes"  # Qwen2.5 / Qwen3 and ChatML models


# -- the conversation -----------------------------------------------------------------------


def template_message(message: ChatMessage, content: Any) -> dict[str, Any]:
    """One message as chat templates take it: tool calls with their arguments as objects
    (the form Hugging Face templates expect) and a tool result's call id."""
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _arguments(call: Any) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        raise OpenAIError(
            400, f"tool call {call.id!r}: arguments are not valid JSON", param="messages"
        ) from None


def hermes_conversation(
    conversation: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """For a template that does not read ``tools``: the tools described in the system
    message, earlier tool calls written into their assistant turns and tool results as
    user turns, all in the Hermes format the ``hermes`` parser reads back."""
    out = []
    for message in conversation:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        message.pop("tool_call_id", None)
        if calls:
            blocks = [
                f"{HERMES_OPEN}\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                )
                + f"\n{HERMES_CLOSE}"
                for c in calls
            ]
            message["content"] = "\n".join([message.get("content") or "", *blocks]).strip()
        if message["role"] == "tool":
            message = {
                "role": "user",
                "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>",
            }
        message["content"] = message.get("content") or ""
        out.append(message)
    if tools:
        described = "\n".join(json.dumps(tool) for tool in tools)
        prompt = (
            "You can call functions to answer. The functions, as JSON schemas:\n"
            f"<tools>\n{described}\n</tools>\n"
            "To call functions, reply with one block per call, each holding a JSON object "
            "with the function's name and its arguments:\n"
            f'{HERMES_OPEN}\n{{"name": <function name>, "arguments": <JSON object>}}\n'
            f"{HERMES_CLOSE}"
        )
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}".strip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# -- parsing the answer ---------------------------------------------------------------------


@dataclass
class ToolCallDelta:
    """A piece of one tool call for a streamed chunk (the first piece names the call)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            function = {"name": self.name, **function}
        out["function"] = function
        return out


@dataclass
class _Call:
    name: str
    arguments: str  # JSON text so far (complete once the parser moves past the call)


@dataclass
class ToolCallParser:
    """Splits one choice's growing text into content and tool calls.

    ``feed(delta)`` returns the content and tool call pieces that are certain now; with
    ``final`` it returns the rest. Subclasses say what the text means in ``parse``.
    """

    parallel: bool = True
    named: str | None = None
    strip: bool = True
    text: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool_calls so far
    content: str = ""
    _sent_args: list[int] = field(default_factory=list)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self.text += delta
        content, calls = self.parse(self.text, final)
        if not self.parallel:
            calls = calls[:1]
        if self.strip:  # whitespace around tool calls is not content
            content = content.strip()
        content_delta = content[len(self.content) :] if len(content) > len(self.content) else ""
        self.content = max(content, self.content, key=len)
        deltas = []
        for index, call in enumerate(calls):
            if index == len(self.calls):
                call_id = f"call_{uuid.uuid4().hex[:24]}"
                self.calls.append(
                    {"id": call_id, "type": "function", "function": {"name": call.name}}
                )
                self._sent_args.append(0)
                deltas.append(ToolCallDelta(index, call.arguments, call_id, call.name))
            elif len(call.arguments) > self._sent_args[index]:
                deltas.append(ToolCallDelta(index, call.arguments[self._sent_args[index] :]))
            else:
                continue
            self._sent_args[index] = len(call.arguments)
            self.calls[index]["function"]["arguments"] = call.arguments
        return content_delta, deltas

    def parse(self, text: str, final: bool) -> tuple[str, list[_Call]]:
        raise NotImplementedError

    def message(self) -> tuple[str | None, list[dict[str, Any]] | None]:
        """The whole message once fed to the end: (content, tool_calls)."""
        return (self.content or None), (self.calls or None)


class PlainParser(ToolCallParser):
    strip: bool = False

    def parse(self, text: str, final: bool) -> tuple[str, list[_Call]]:
        return text, []


class NamedParser(ToolCallParser):
    """The whole output is the named function's arguments (grammar-forced)."""

    def parse(self, text: str, final: bool) -> tuple[str, list[_Call]]:
        return "", [_Call(str(self.named), text)] if text or final else []


class RequiredParser(ToolCallParser):
    """The whole output is a JSON array of {"name", "arguments"} (grammar-forced); each
    call is returned once its object is complete."""

    def parse(self, text: str, final: bool) -> tuple[str, list[_Call]]:
        start = text.find("[")
        calls, _, rest = _array_calls(text, start + 1) if start >= 0 else ([], None, "")
        return (rest if final else ""), calls


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks among content."""

    def parse(self, text: str, final: bool) -> tuple[str, list[_Call]]:
        content, calls, pos = [], [], 0
        while True:
            start = text.find(HERMES_OPEN, pos)
            if start < 0:
                tail = text[pos:]
                if not final:  # hold back what may be the start of a tag
                    tail = tail[: len(tail) - _partial_suffix(tail, HERMES_OPEN)]
                content.append(tail)
                break
            content.append(text[pos:start])
            end = text.find(HERMES_CLOSE, start)
            if end < 0 and not final:
                break
            body = text[start + len(HERMES_OPEN) : end if end >= 0 else len(text)]
            call = _call_from_json(body)
            if call is None:
                content.append(text[start : end + len(HERMES_CLOSE) if end >= 0 else len(text)])
            else:
                calls.append(call)
            if end < 0:
                break
            pos = end + len(HERMES_CLOSE)
        return "".join(content), calls


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x: the answer is ``{"name": ..., "parameters": {...}}`` objects (after an
    optional ``<|python_tag|>``, separated by ``;``), or plain content."""

    def parse(self, text: str, final: bool) -> tuple[str, list[_Call]]:
        body = text.lstrip()
        body = body.removeprefix(PYTHON_TAG).lstrip()
        if not body or PYTHON_TAG.startswith(text.strip()):
            return (text if final else ""), []
        if not body.startswith("{"):
            return text, []
        calls, pos = [], 0
        while pos < len(body):
            end = _value_end(body, pos)
            if end is None:
                break
            call = _call_from_json(body[pos:end])
            if call is None:
                break
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
            if pos < len(body) and body[pos] != "{":
                break
        rest = body[pos:] if final else ""
        return (rest if calls else (text if final else "")), calls


class MistralParser(ToolCallParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON array of calls (the tag is a special token, so
    the text may start with the array itself), or plain content."""

    def parse(self, text: str, final: bool) -> tuple[str, list[_Call]]:
        body = text.lstrip()
        if MISTRAL_TAG.startswith(body) and not final:
            return "", []
        tagged = body.startswith(MISTRAL_TAG)
        body = body.removeprefix(MISTRAL_TAG).lstrip()
        if not body:
            return ("" if tagged or not final else text), []
        if not body.startswith("["):
            return text, []
        calls, done, rest = _array_calls(body, 1)
        if not calls and (done is False or final):
            return (text if final else ""), []
        return (rest if final else ""), calls


PARSERS: dict[str, type[ToolCallParser]] = {
    "none": PlainParser,
    "named": NamedParser,
    "required": RequiredParser,
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def _value_end(text: str, start: int) -> int | None:
    """The index after the JSON object or array at ``text[start]``; None if it is cut off."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _array_calls(text: str, pos: int) -> tuple[list[_Call], bool | None, str]:
    """The complete call objects of a JSON array whose items start at ``pos``.

    Returns (calls, done, rest): done is True at the closing bracket, None while cut off,
    False on something that is not a call; rest is the text after the array.
    """
    calls: list[_Call] = []
    while pos < len(text):
        char = text[pos]
        if char in " \n\t\r,":
            pos += 1
        elif char == "]":
            return calls, True, text[pos + 1 :]
        elif char == "{":
            end = _value_end(text, pos)
            if end is None:
                return calls, None, ""
            call = _call_from_json(text[pos:end])
            if call is None:
                return calls, False, text[pos:]
            calls.append(call)
            pos = end
        else:
            return calls, False, text[pos:]
    return calls, None, ""


def _call_from_json(body: str) -> _Call | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return _Call(obj["name"], arguments)
