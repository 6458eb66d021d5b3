"""Request -> engine sampling fields, with the checks that need the model or the caps.

Every rejection is an OpenAIError(400) naming the field, raised before anything is queued.
Stop strings are not sent to the engine: the ingress owns text and applies them itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.errors import OpenAIError
from app.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from neuron_runtime.sampling_params import SamplingParams
from neuron_runtime.structured_output import StructuredOutputsParams


@dataclass(frozen=True)
class Limits:
    """What the served model allows and what the operator caps."""

    max_model_len: int
    vocab_size: int
    max_n: int
    max_prompts: int
    max_stop_strings: int = 16


@dataclass(frozen=True)
class Constraint:
    """The grammar a request's output must follow, and the request field it came from (a
    400 about the grammar names that field)."""

    params: StructuredOutputsParams
    param: str


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def output_constraint(request: SamplingFields) -> Constraint | None:
    """The request's constraint from ``response_format``, ``structured_outputs`` or one of
    vLLM's ``guided_*`` fields (at most one of them); None for free text."""
    given = []
    if request.response_format is not None and request.response_format.type != "text":
        given.append("response_format")
    if request.structured_outputs is not None:
        given.append("structured_outputs")
    given += [name for name in GUIDED_FIELDS if getattr(request, name) is not None]
    if len(given) > 1:
        raise OpenAIError(
            400, f"give at most one output constraint, got {', '.join(given)}", param=given[1]
        )
    if request.guided_whitespace_pattern is not None and given != ["guided_json"]:
        raise OpenAIError(400, "it applies only to guided_json", param="guided_whitespace_pattern")
    if not given:
        return None
    source = given[0]
    try:
        if source == "response_format":
            fmt = request.response_format
            assert fmt is not None
            if fmt.json_schema is None:
                return Constraint(StructuredOutputsParams(json_object=True), source)
            schema = fmt.json_schema.json_schema
            return Constraint(StructuredOutputsParams(json=schema), "response_format.json_schema")
        if source == "structured_outputs":
            assert request.structured_outputs is not None
            fields = request.structured_outputs.model_dump(by_alias=True, exclude_unset=True)
            return Constraint(StructuredOutputsParams(**fields), source)
        value = getattr(request, source)
        kind = source.removeprefix("guided_")
        extra: dict[str, Any] = {}
        if request.guided_whitespace_pattern is not None:
            extra["whitespace_pattern"] = request.guided_whitespace_pattern
        return Constraint(StructuredOutputsParams(**{kind: value}, **extra), source)
    except ValueError as exc:
        raise OpenAIError(400, f"{source}: {exc}", param=source) from exc


def stop_strings(request: SamplingFields) -> list[str]:
    stop = request.stop
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stop):
        raise OpenAIError(400, "stop strings must be non-empty", param="stop")
    return stop


def check_prompt_ids(ids: list[int], limits: Limits, param: str) -> None:
    if not ids:
        raise OpenAIError(400, "the prompt is empty", param=param)
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise OpenAIError(
            400, f"token ids must be in [0, {limits.vocab_size}), got {bad[:5]}", param=param
        )
    if len(ids) >= limits.max_model_len:
        raise OpenAIError(
            400,
            f"the prompt has {len(ids)} tokens; this model's maximum context length is "
            f"{limits.max_model_len} tokens, which must leave room for at least one output token",
            param=param,
        )


def sampling_fields(
    request: ChatCompletionRequest | CompletionRequest,
    num_prompt_tokens: int,
    limits: Limits,
    constraint: Constraint | None = None,
) -> dict[str, Any]:
    """The SamplingParams fields for one prompt of ``request`` (validated by constructing it);
    ``constraint``: the grammar the output must follow."""
    if request.n > limits.max_n:
        raise OpenAIError(400, f"n must be at most {limits.max_n}, got {request.n}", param="n")
    if len(stop_strings(request)) > limits.max_stop_strings:
        raise OpenAIError(400, f"at most {limits.max_stop_strings} stop strings", param="stop")
    max_tokens, param = request.max_tokens, "max_tokens"
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        max_tokens, param = request.max_completion_tokens, "max_completion_tokens"
    room = limits.max_model_len - num_prompt_tokens
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise OpenAIError(
            400,
            f"{param} ({max_tokens}) + prompt tokens ({num_prompt_tokens}) exceeds the "
            f"model's maximum context length ({limits.max_model_len})",
            param=param,
        )
    if request.min_tokens > max_tokens:
        raise OpenAIError(
            400, f"min_tokens ({request.min_tokens}) exceeds {param} ({max_tokens})", "min_tokens"
        )
    fields: dict[str, Any] = {
        "n": request.n,
        "max_tokens": max_tokens,
        "min_tokens": request.min_tokens,
        "seed": request.seed,
        "stop_token_ids": list(request.stop_token_ids or []),
        "ignore_eos": request.ignore_eos,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "logit_bias": logit_bias(request.logit_bias, limits.vocab_size),
        "allowed_token_ids": request.allowed_token_ids,
        "bad_words": request.bad_words,
        "detokenize": False,
        "logprobs": logprobs_count(request),
        "prompt_logprobs": request.prompt_logprobs,
        "structured_outputs": None if constraint is None else constraint.params,
    }
    if request.prompt_logprobs is not None and request.stream:
        raise OpenAIError(
            400, "prompt_logprobs is not available with stream=true", param="prompt_logprobs"
        )
    for name, value in (
        ("temperature", request.temperature),
        ("top_p", request.top_p),
        ("top_k", request.top_k),
        ("min_p", request.min_p),
    ):
        if value is not None:
            fields[name] = value
    for name in ("stop_token_ids", "allowed_token_ids"):
        outside = [t for t in fields[name] or [] if not 0 <= t < limits.vocab_size]
        if outside:
            raise OpenAIError(400, f"{name} out of the vocabulary: {outside[:5]}", param=name)
    try:
        SamplingParams(**fields)
    except ValueError as exc:  # a check the pydantic model does not repeat
        raise OpenAIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from exc
    return fields


def logprobs_count(request: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise OpenAIError(
                400, f"logit_bias key {key!r} is not a token id", param="logit_bias"
            ) from None
        if not 0 <= token_id < vocab_size:
            raise OpenAIError(
                400,
                f"logit_bias token id {token_id} is outside [0, {vocab_size})",
                param="logit_bias",
            )
        if not -100.0 <= value <= 100.0:
            raise OpenAIError(
                400, f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias"
            )
        out[token_id] = float(value)
    return out
