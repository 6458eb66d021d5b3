"""The OpenAI ingress deployment: FastAPI under ``@serve.ingress``, holding no engine.

It validates requests, applies the chat template, tokenizes, calls the LLM deployment through
a streaming DeploymentHandle, detokenizes incrementally, applies stop strings and writes JSON
or SSE. Embeddings go to the embedding deployment.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app.errors import OpenAIError, install_handlers, sse_error
from app.generation import Generation, PromptStream
from app.images import (
    ImageData,
    ImageInputError,
    ImageLimits,
    check_image_count,
    load_image_url,
)
from app.metrics import RequestTimer, ServingMetrics
from app.middleware import EdgeMiddleware
from app.profiling import ProfileControl, ProfilerConfig
from app.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from app.request_trace import request_attributes
from app.responses import ResponsesRequest, response_events, response_object, to_chat_request
from app.sampling import (
    Constraint,
    Limits,
    check_prompt_ids,
    output_constraint,
    sampling_fields,
    stop_strings,
)
from app.text import SequenceText, chat_logprobs, completion_logprobs, prompt_logprobs
from app.tools import ToolSetup, hermes_conversation, template_message, tool_setup
from deployments.protocol import DecodeRequest, GenerateRequest, ImagePart
from deployments.step_channel import this_node
from deployments.thread_priority import lower_priority, thread_ids
from neuron_runtime import tracing
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.multimodal import place_images, vision_spec
from neuron_runtime.structured_output import GrammarCompiler, StructuredOutputsParams
from neuron_runtime.tokenizer import Tokenizer
from router.migration import REOPEN_RETRY_S, is_replica_lost
from router.streams import StepSubscriber, coalesce


@dataclass(frozen=True)
class IngressConfig:
    served_model_name: str
    engine_args: dict[str, Any]
    embedding_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_n: int = 8
    max_prompts: int = 16
    step_channels: bool = True
    step_channel_sockets: bool = True
    # Streamed SSE events are sent to the HTTP proxy at most once per this (router/streams.py
    # coalesce); 0: each as it comes.
    stream_batching_interval_ms: float = 0.0
    # Times a request may resume on another replica after its own was lost (router/migration.py).
    max_migrations: int = 3
    max_embedding_inputs: int = 128
    retry_after_s: int = 1
    # ImageLimits fields (app/images.py): caps on image bytes, pixels and count, remote URLs.
    image_limits: dict[str, Any] = field(default_factory=dict)
    # A grammar (response_format, tools, ...) not compiled within this is refused with a 400.
    grammar_timeout_s: float = 10.0
    # TracingConfig fields (neuron_runtime/tracing.py); empty: tracing off.
    tracing: dict[str, Any] = field(default_factory=dict)
    # ProfilerConfig fields (app/profiling.py): where /start_profile's traces go.
    profiler: dict[str, Any] = field(default_factory=dict)
    # This replica's threads run at least this many nice steps behind its Python threads
    # (at Ray's worker niceness, as the engines'; deployments/thread_priority.py); None:
    # as Ray set them.
    serving_threads_nice: int | None = None
    # With a decode handle (disaggregated, direct_decode): a request of one sequence, no
    # images and a prompt of at most this many tokens goes straight to a decode replica,
    # which prefills it itself, not through the PD router.
    direct_decode_max_prompt_tokens: int = 0


@serve.deployment(name="OpenAIIngress", ray_actor_options={"num_cpus": 0.25})
@serve.ingress()
class OpenAIIngress:
    def __init__(
        self,
        llm: DeploymentHandle,
        embedder: DeploymentHandle | None,
        config: dict[str, Any],
        decode: DeploymentHandle | None = None,
    ) -> None:
        self.config = IngressConfig(**config)
        tracing.configure(self.config.tracing, "ingress")
        self.llm = llm
        self.llm_stream = llm.options(stream=True)
        # Tokens after a request's first come over step channels, one message per engine
        # step for all of this replica's requests on an engine (or PD router) replica.
        node = this_node() if self.config.step_channel_sockets else None
        min_requests = 2 if self.config.step_channels else None
        self.steps = StepSubscriber(self.llm_stream, "ingress", min_requests, node)
        # Requests sent straight to decode replicas (IngressConfig.direct_decode_max_prompt_tokens).
        self.decode_steps: StepSubscriber | None = None
        if decode is not None:
            self.decode_steps = StepSubscriber(
                decode.options(stream=True), "ingress-decode", min_requests, node
            )
        self.embedder = embedder
        engine_config = EngineArgs(**self.config.engine_args).create_engine_config()
        self.tokenizer = Tokenizer(engine_config.model.path)
        self.limits = Limits(
            max_model_len=engine_config.model.max_model_len,
            vocab_size=engine_config.model.vocab_size,
            max_n=self.config.max_n,
            max_prompts=self.config.max_prompts,
        )
        self.vision = vision_spec(engine_config.model.hf_config)  # None: a text-only model
        limits = dict(self.config.image_limits)
        limits["allowed_domains"] = tuple(limits.get("allowed_domains", ()))
        self.image_limits = ImageLimits(**limits)
        self.metrics = ServingMetrics(self.config.served_model_name)
        self.created = int(time.time())
        # Grammars are compiled here once to refuse bad ones with a 400 before they queue.
        self.grammars = GrammarCompiler(
            self.tokenizer.hf_tokenizer,
            engine_config.model.vocab_size,
            self.tokenizer.eos_token_id,
            timeout_s=self.config.grammar_timeout_s,
        )
        self.model_type = str(engine_config.model.text_config.get("model_type", ""))
        self.profiles = ProfileControl(ProfilerConfig(**self.config.profiler))
        # No thread ahead of the engines' (deployments/thread_priority.py).
        lower_priority(thread_ids(), self.config.serving_threads_nice)

    def _sse(self, events: AsyncIterator[str]) -> StreamingResponse:
        interval_s = self.config.stream_batching_interval_ms / 1000
        if interval_s > 0:
            events = coalesce(events, interval_s)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_fastapi(self)

    # -- generation -------------------------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest, request_id: str) -> Response:
        generation, tools = await self._start_chat(request, f"chatcmpl-{request_id}")
        if request.stream:
            return self._sse(
                self._chat_stream(request, generation, f"chatcmpl-{request_id}", tools)
            )
        num_top = request.top_logprobs or 0
        outputs = await _collect(generation)
        choices = []
        for index, seq in enumerate(generation.choices):
            text, logprobs = outputs[index]
            message, finish_reason = _chat_message(text, seq.finish_reason, tools)
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": seq.stop_reason,
            }
            if request.logprobs:
                choice["logprobs"] = {"content": chat_logprobs(self.tokenizer, logprobs, num_top)}
            choices.append(choice)
        response = ChatCompletionResponse(
            id=f"chatcmpl-{request_id}",
            model=self.config.served_model_name,
            choices=choices,
            usage=generation.usage(),
            prompt_logprobs=prompt_logprobs(
                self.tokenizer, generation.prompt_logprobs[0], request.prompt_logprobs or 0
            ),
        )
        return JSONResponse(response.model_dump())

    async def responses(self, request: ResponsesRequest, request_id: str) -> Response:
        """``POST /v1/responses`` (stateless): the chat pipeline, answered as a Response."""
        chat = to_chat_request(request)
        generation, tools = await self._start_chat(chat, f"resp_{request_id}")
        model = self.config.served_model_name
        if request.stream:
            return self._sse(
                response_events(request, generation, tools, f"resp_{request_id}", model)
            )
        outputs = await _collect(generation)
        (seq,) = generation.choices
        body = response_object(
            request,
            f"resp_{request_id}",
            model,
            outputs[0][0],
            seq.finish_reason,
            tools,
            generation.usage(),
        )
        return JSONResponse(body)

    async def _start_chat(
        self, request: ChatCompletionRequest, engine_id: str
    ) -> tuple[Generation, ToolSetup | None]:
        """Tools, output constraint, prompt and images checked; the engine streams opened."""
        self._check_model(request.model)
        with tracing.span("ingress.output_constraint"):
            tools = tool_setup(request, self.tokenizer.chat_template, self.model_type)
            constraint = await self._constraint(request, tools)
        prompt_ids, images = await self._encode_chat(request.messages, tools)
        check_prompt_ids(prompt_ids, self.limits, "messages")
        generation = await self._start(request, [prompt_ids], engine_id, images, constraint)
        return generation, tools

    async def _constraint(
        self, request: ChatCompletionRequest | CompletionRequest, tools: ToolSetup | None = None
    ) -> Constraint | None:
        """The grammar the output must follow, compiled once here: a bad one is a 400."""
        if tools is not None and tools.mode != "none":
            assert isinstance(request, ChatCompletionRequest)
            for index, tool in enumerate(request.tools or []):
                if tool.function.parameters is not None:
                    param = f"tools[{index}].function.parameters"
                    try:
                        params = StructuredOutputsParams(json=tool.function.parameters)
                    except ValueError as exc:
                        raise OpenAIError(400, f"{param}: {exc}", param=param) from exc
                    await self._check_grammar(Constraint(params, param))
        if tools is not None and tools.constraint is not None:
            constraint: Constraint | None = tools.constraint
        else:
            constraint = output_constraint(request)
        if constraint is not None:
            await self._check_grammar(constraint)
        return constraint

    async def _check_grammar(self, constraint: Constraint) -> None:
        job = self.grammars.submit(constraint.params)
        compiled = asyncio.wrap_future(job.future)
        done, _ = await asyncio.wait({compiled}, timeout=self.grammars.timeout_s)
        param = constraint.param
        if not done:
            compiled.add_done_callback(lambda f: f.exception())  # retrieved, not logged
            timeout = self.grammars.timeout_s
            raise OpenAIError(
                400, f"{param}: the grammar did not compile within {timeout:g} s", param=param
            )
        exc = compiled.exception()
        if exc is not None:
            raise OpenAIError(400, f"{param}: {exc}", param=param)

    async def completion(self, request: CompletionRequest, request_id: str) -> Response:
        self._check_model(request.model)
        if request.echo:
            raise OpenAIError(400, "echo is not supported", param="echo")
        if request.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        with tracing.span("ingress.tokenize"):
            prompts = self._encode_prompts(request.prompt)
        constraint = await self._constraint(request)
        generation = await self._start(request, prompts, f"cmpl-{request_id}", None, constraint)
        if request.stream:
            return self._sse(self._completion_stream(request, generation, f"cmpl-{request_id}"))
        outputs = await _collect(generation)
        choices = []
        for index, seq in enumerate(generation.choices):
            text, logprobs = outputs[index]
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": None
                    if request.logprobs is None
                    else completion_logprobs(self.tokenizer, logprobs, request.logprobs, 0),
                    "finish_reason": seq.finish_reason,
                    "stop_reason": seq.stop_reason,
                    "prompt_logprobs": prompt_logprobs(
                        self.tokenizer,
                        generation.prompt_logprobs[index // request.n],
                        request.prompt_logprobs or 0,
                    ),
                }
            )
        response = CompletionResponse(
            id=f"cmpl-{request_id}",
            model=self.config.served_model_name,
            choices=choices,
            usage=generation.usage(),
        )
        return JSONResponse(response.model_dump())

    async def _start(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        prompts: list[list[int]],
        engine_id: str,
        images: list[ImagePart] | None = None,
        constraint: Constraint | None = None,
    ) -> Generation:
        """Validates, opens one engine stream per prompt and waits for each first step, so
        that rejections (400, 503) still get a proper status code."""
        with tracing.span("ingress.validate"):
            fields = [
                sampling_fields(request, len(ids), self.limits, constraint) for ids in prompts
            ]
        model = self.config.served_model_name
        request_attributes(request, model, engine_id, fields[0], len(prompts))
        trace_context = tracing.inject()  # the root span's, for the engine deployment
        stop = stop_strings(request)
        seq_texts = [
            [
                SequenceText(
                    self.tokenizer,
                    ids,
                    stop,
                    request.include_stop_str_in_output,
                    request.skip_special_tokens,
                    request.min_tokens,
                )
                for _ in range(request.n)
            ]
            for ids in prompts
        ]
        timer = RequestTimer(self.metrics)
        tasks = [
            asyncio.create_task(
                self._open(
                    GenerateRequest(f"{engine_id}-{i}", ids, f, list(images or []), trace_context),
                    self.config.max_migrations,
                )
            )
            for i, (ids, f) in enumerate(zip(prompts, fields, strict=True))
        ]
        try:
            streams = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result().cancel()
            raise
        return Generation(list(streams), seq_texts, timer)

    async def _open(self, request: GenerateRequest, retries: int = 0) -> PromptStream:
        """Submits the request; one whose replica is lost before its first step (nothing was
        sent to the client yet) is submitted again, up to ``retries`` times, under an id of
        its own (``.r1``...: the lost replica's calls downstream may still hold the first)."""
        first_id = request.request_id
        steps = self._steps_for(request)
        for attempt in range(retries + 1):
            if attempt:
                request = dataclasses.replace(request, request_id=f"{first_id}.r{attempt}")
            steps.expect(request.request_id)
            try:
                return await self._submit(request, steps)
            except Exception as exc:
                steps.forget(request.request_id)
                if attempt == retries or not is_replica_lost(exc):
                    raise
            except BaseException:
                steps.forget(request.request_id)
                raise
            await asyncio.sleep(REOPEN_RETRY_S)
        raise AssertionError("unreachable")

    def _steps_for(self, request: GenerateRequest) -> StepSubscriber:
        """Where the request goes: the LLM deployment (LLMServer or PD router), or straight
        to a decode replica (``decode_steps``) for a short, single-sequence text prompt."""
        if (
            self.decode_steps is not None
            and not request.images
            and int(request.sampling.get("n") or 1) == 1
            and len(request.prompt_token_ids) <= self.config.direct_decode_max_prompt_tokens
        ):
            return self.decode_steps
        return self.steps

    async def _submit(self, request: GenerateRequest, steps: StepSubscriber) -> PromptStream:
        # A stream=True handle: remote() returns a DeploymentResponseGenerator; it carries the
        # first step, the step channel the rest.
        if steps is self.steps:
            call = self.llm_stream.generate.remote(request, steps.subscriber)
        else:
            # Prefilled by the decode replica, as the PD router sends it there (a resumed
            # request's sampling already leaves out what its first tokens carried).
            call = steps.handle.generate.remote(DecodeRequest.whole(request), steps.subscriber)
        stream = cast(DeploymentResponseGenerator, call)
        try:
            first = await stream.__anext__()
        except BackPressureError as exc:
            raise self._overloaded() from exc
        except ValueError as exc:  # the engine's own validation (RayTaskError subclasses it)
            stream.cancel()
            raise OpenAIError(400, _first_line(exc)) from exc
        except StopAsyncIteration as exc:
            raise OpenAIError(500, "the engine returned no output") from exc
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as exc:
            stream.cancel()
            if isinstance(getattr(exc, "cause", None), BackPressureError):
                raise self._overloaded() from exc
            raise OpenAIError(500, f"generation failed: {_first_line(exc)}") from exc
        rest = steps.follow(request.request_id, first, stream)
        # A request whose replica (LLMServer, a decode replica, or a PD router: that one
        # migrates what its decode replicas lose) is lost mid-stream resumes on another one.
        return PromptStream(
            first,
            rest,
            request,
            self._open,
            self.config.max_migrations,
        )

    def _overloaded(self) -> OpenAIError:
        return OpenAIError(
            503,
            "the server is overloaded; retry later",
            code="overloaded",
            headers={"Retry-After": str(self.config.retry_after_s)},
        )

    async def _chat_stream(
        self,
        request: ChatCompletionRequest,
        generation: Generation,
        response_id: str,
        tools: ToolSetup | None = None,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.config.served_model_name
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        num_top = request.top_logprobs or 0

        head = {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            return _sse_chunk(head, choices, usage, include_usage)

        yield chunk(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(len(generation.choices))
            ]
        )
        parsers = [tools.new_parser() if tools else None for _ in generation.choices]
        try:
            async for events in generation.events():
                choices = []
                for event in events:
                    delta: dict[str, Any] = {"content": event.text} if event.text else {}
                    finish_reason = event.finish_reason
                    parser = parsers[event.index]
                    if parser is not None:
                        assert tools is not None
                        final = finish_reason is not None
                        content, calls = parser.feed(event.text, final)
                        delta = {"content": content} if content else {}
                        if calls:
                            delta["tool_calls"] = [call.to_openai() for call in calls]
                        if final:
                            finish_reason = tools.finish_reason(finish_reason, len(parser.calls))
                    choice: dict[str, Any] = {
                        "index": event.index,
                        "delta": delta,
                        "logprobs": None,
                        "finish_reason": finish_reason,
                    }
                    if event.finish_reason is not None:
                        choice["stop_reason"] = event.stop_reason
                    if request.logprobs and event.logprobs:
                        choice["logprobs"] = {
                            "content": chat_logprobs(self.tokenizer, event.logprobs, num_top)
                        }
                    choices.append(choice)
                yield chunk(choices)
            if include_usage:
                yield chunk([], generation.usage())
        except Exception as exc:  # noqa: BLE001 - the stream must end cleanly
            yield sse_error(f"generation failed: {_first_line(exc)}")
        yield "data: [DONE]\n\n"

    async def _completion_stream(
        self, request: CompletionRequest, generation: Generation, response_id: str
    ) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.config.served_model_name
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        offsets = [0] * len(generation.choices)

        head = {"id": response_id, "object": "text_completion", "created": created, "model": model}

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            return _sse_chunk(head, choices, usage, include_usage)

        try:
            async for events in generation.events():
                choices = []
                for event in events:
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = completion_logprobs(
                            self.tokenizer, event.logprobs, request.logprobs, offsets[event.index]
                        )
                    offsets[event.index] += len(event.text)
                    choices.append(
                        {
                            "index": event.index,
                            "text": event.text,
                            "logprobs": logprobs,
                            "finish_reason": event.finish_reason,
                            "stop_reason": event.stop_reason,
                        }
                    )
                yield chunk(choices)
            if include_usage:
                yield chunk([], generation.usage())
        except Exception as exc:  # noqa: BLE001 - the stream must end cleanly
            yield sse_error(f"generation failed: {_first_line(exc)}")
        yield "data: [DONE]\n\n"

    # -- prompts ----------------------------------------------------------------------------

    async def _encode_chat(
        self, messages: list[ChatMessage], tools: ToolSetup | None = None
    ) -> tuple[list[int], list[ImagePart]]:
        """The chat's prompt ids (image placeholders expanded) and its images, checked at the
        edge (app/images.py) before anything is queued; ``tools`` go to the template."""
        conversation: list[dict[str, Any]] = []
        pending: list[tuple[str, str]] = []  # (url, param) in prompt order
        for index, message in enumerate(messages):
            content: Any = message.content
            if isinstance(content, list):
                parts: list[dict[str, Any]] = []
                for j, part in enumerate(content):
                    param = f"messages[{index}].content[{j}]"
                    kind = part.get("type")
                    if kind == "text" and isinstance(part.get("text"), str):
                        parts.append({"type": "text", "text": part["text"]})
                    elif kind == "image_url" and self.vision is not None:
                        url = (part.get("image_url") or {}).get("url")
                        if not isinstance(url, str):
                            raise OpenAIError(400, f"{param}.image_url.url must be a string", param)
                        pending.append((url, f"{param}.image_url"))
                        parts.append({"type": "image"})
                    elif kind == "image_url":
                        raise OpenAIError(400, f"{param}: this model does not accept images", param)
                    else:
                        raise OpenAIError(
                            400, f"{param}: unsupported content part type {kind!r}", param
                        )
                # Text-only lists render as one string: every chat template takes that.
                if all(p["type"] == "text" for p in parts):
                    content = "\n".join(p["text"] for p in parts)
                else:
                    content = parts
            conversation.append(template_message(message, content or ""))
        try:
            check_image_count(len(pending), self.image_limits, "messages")
            # A task group: the first refused image cancels the other downloads.
            async with asyncio.TaskGroup() as group:
                loads = [
                    group.create_task(load_image_url(url, self.image_limits, param))
                    for url, param in pending
                ]
        except* ImageInputError as refused:
            exc = refused.exceptions[0]
            assert isinstance(exc, ImageInputError)
            raise OpenAIError(exc.status_code, exc.message, param=exc.param) from exc
        images = [load.result() for load in loads]
        template_tools = tools.tools if tools is not None and tools.tools else None
        has_tool_turns = any(m.tool_calls or m.role == "tool" for m in messages)
        if (tools is not None and tools.inject) or (
            has_tool_turns and "tools" not in (self.tokenizer.chat_template or "")
        ):
            conversation = hermes_conversation(conversation, template_tools or [])
            template_tools = None
        try:
            with tracing.span("ingress.chat_template") as span:
                ids = self.tokenizer.encode_chat(conversation, template_tools)
                tracing.set_attributes(span, {"neuron_serve.prompt_tokens": len(ids)})
        except UnicodeError as exc:
            raise OpenAIError(400, f"messages hold invalid text: {exc}", "messages") from exc
        except Exception as exc:  # jinja errors: roles the template refuses, and the like
            raise OpenAIError(
                400, f"the chat template rejected the messages: {exc}", "messages"
            ) from exc
        if self.vision is None:
            return ids, []
        return self._place_images(ids, images)

    def _place_images(
        self, ids: list[int], images: list[ImageData]
    ) -> tuple[list[int], list[ImagePart]]:
        assert self.vision is not None
        try:
            ids, spans = place_images(
                ids, self.vision.image_token_id, self.vision.tokens_per_image, len(images)
            )
        except ValueError as exc:
            raise OpenAIError(400, f"messages: {exc}", "messages") from exc
        parts = [
            ImagePart(offset, length, image.content_hash, data=image.data)
            for (offset, length), image in zip(spans, images, strict=True)
        ]
        return ids, parts

    def _encode_prompts(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts: list = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise OpenAIError(400, "the prompt is empty", param="prompt")
        if len(prompts) > self.limits.max_prompts:
            raise OpenAIError(
                400,
                f"at most {self.limits.max_prompts} prompts per request, got {len(prompts)}",
                param="prompt",
            )
        out = []
        for p in prompts:
            if isinstance(p, str):
                try:
                    ids = self.tokenizer.encode(p) if p else []
                except UnicodeError as exc:
                    raise OpenAIError(400, f"invalid text in prompt: {exc}", "prompt") from exc
            else:
                ids = list(p)
            check_prompt_ids(ids, self.limits, "prompt")
            if self.vision is not None and self.vision.image_token_id in ids:
                # Completions carry no images: an image placeholder would have nothing to fill.
                raise OpenAIError(
                    400,
                    "the prompt holds the image placeholder token; images go through "
                    "/v1/chat/completions",
                    param="prompt",
                )
            out.append(ids)
        return out

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise OpenAIError(
                404,
                f"the model {model!r} does not exist; this server serves "
                f"{self.config.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    # -- other endpoints --------------------------------------------------------------------

    async def embeddings(self, request: EmbeddingRequest) -> dict[str, Any]:
        name = self.config.embedding_model_name
        if self.embedder is None or name is None:
            raise OpenAIError(
                404, "no embedding model is served", param="model", code="model_not_found"
            )
        if request.model is not None and request.model != name:
            raise OpenAIError(
                404,
                f"the embedding model {request.model!r} does not exist; "
                f"this server serves {name!r}",
                param="model",
                code="model_not_found",
            )
        inputs: list = request.input if isinstance(request.input, list) else [request.input]
        if inputs and all(isinstance(x, int) for x in inputs):
            inputs = [inputs]
        if not inputs:
            raise OpenAIError(400, "input is empty", param="input")
        if len(inputs) > self.config.max_embedding_inputs:
            raise OpenAIError(
                400, f"at most {self.config.max_embedding_inputs} inputs", param="input"
            )
        try:
            reply = await self.embedder.embed.remote(inputs, True)
        except BackPressureError as exc:
            raise self._overloaded() from exc
        except ValueError as exc:
            raise OpenAIError(400, _first_line(exc), param="input") from exc
        vectors: np.ndarray = reply.embeddings
        if request.dimensions is not None and request.dimensions != vectors.shape[1]:
            raise OpenAIError(
                400, f"this model has {vectors.shape[1]} dimensions", param="dimensions"
            )
        data = []
        for index, row in enumerate(vectors):
            embedding: Any = row.tolist()
            if request.encoding_format == "base64":
                embedding = base64.b64encode(row.astype("<f4").tobytes()).decode()
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        tokens = int(sum(reply.num_prompt_tokens))
        return {
            "object": "list",
            "data": data,
            "model": name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    def models(self) -> dict[str, Any]:
        data = [
            {
                "id": self.config.served_model_name,
                "object": "model",
                "created": self.created,
                "owned_by": "neuron-serve",
                "max_model_len": self.limits.max_model_len,
            }
        ]
        if self.config.embedding_model_name:
            data.append(
                {
                    "id": self.config.embedding_model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "neuron-serve",
                }
            )
        return {"object": "list", "data": data}

    async def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        self._check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError(400, "give exactly one of prompt and messages", param="prompt")
        if request.messages is not None:
            ids, _ = await self._encode_chat(request.messages)
        else:
            try:
                ids = self.tokenizer.encode(request.prompt or "", request.add_special_tokens)
            except UnicodeError as exc:
                raise OpenAIError(400, f"invalid text in prompt: {exc}", "prompt") from exc
        return {"tokens": ids, "count": len(ids), "max_model_len": self.limits.max_model_len}

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(request.model)
        bad = [t for t in request.tokens if not 0 <= t < self.limits.vocab_size]
        if bad:
            raise OpenAIError(400, f"token ids out of the vocabulary: {bad[:5]}", "tokens")
        return {"prompt": self.tokenizer.decode(request.tokens, skip_special_tokens=False)}

    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self.llm.check_health.remote(), timeout=10)
        except Exception as exc:  # noqa: BLE001 - any failure means not healthy
            return JSONResponse(
                OpenAIError(503, f"unhealthy: {_first_line(exc)}").body(), status_code=503
            )
        return Response(status_code=200)

    async def render_metrics(self) -> Response:
        try:
            stats = await asyncio.wait_for(self.llm.stats.remote(), timeout=2)
            self.metrics.update_engine_stats(stats)
        except Exception:  # noqa: BLE001, S110 - serve the last known numbers
            pass
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def build_fastapi(ingress: OpenAIIngress) -> FastAPI:
    """The HTTP surface; routes are closures over the replica's ingress object."""
    # The schema of every route (clients, fuzzers); no interactive docs pages.
    api = FastAPI(title="neuron-serve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_handlers(api)
    api.add_middleware(
        EdgeMiddleware,
        api_key=ingress.config.api_key,
        max_body_bytes=ingress.config.max_body_bytes,
    )

    @api.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest, raw: Request) -> Response:
        return await ingress.chat(request, _request_id(raw))

    @api.post("/v1/responses")
    async def responses(request: ResponsesRequest, raw: Request) -> Response:
        return await ingress.responses(request, _request_id(raw))

    @api.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        return await ingress.completion(request, _request_id(raw))

    @api.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest) -> dict[str, Any]:
        return await ingress.embeddings(request)

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ingress.models()

    @api.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict[str, Any]:
        return await ingress.tokenize(request)

    @api.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict[str, Any]:
        return ingress.detokenize(request)

    @api.get("/health")
    async def health() -> Response:
        return await ingress.health()

    @api.post("/start_profile")
    async def start_profile() -> dict[str, Any]:
        return await ingress.profiles.start()

    @api.post("/stop_profile")
    async def stop_profile() -> dict[str, Any]:
        return await ingress.profiles.stop()

    @api.get("/metrics")
    async def metrics() -> Response:
        return await ingress.render_metrics()

    return api


def _chat_message(
    text: str, finish_reason: str | None, tools: ToolSetup | None
) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a choice and its finish reason (tool calls parsed out)."""
    if tools is None:
        return {"role": "assistant", "content": text}, finish_reason
    parser = tools.new_parser()
    parser.feed(text, final=True)
    content, calls = parser.message()
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    return message, tools.finish_reason(finish_reason, len(calls or []))


def _request_id(raw: Request) -> str:
    # Ray Serve's proxy sets X-Request-Id (the client's, else a fresh one) and echoes it;
    # a uuid suffix keeps engine ids unique even when a client reuses its id.
    given = raw.headers.get("x-request-id", "")[:64]
    suffix = uuid.uuid4().hex[:12]
    return f"{given}-{suffix}" if given else uuid.uuid4().hex


async def _collect(generation: Generation) -> list[tuple[str, list]]:
    outputs: list[tuple[str, list]] = [("", []) for _ in generation.choices]
    try:
        async for events in generation.events():
            for event in events:
                text, logprobs = outputs[event.index]
                outputs[event.index] = (text + event.text, logprobs + event.logprobs)
    except Exception as exc:  # EngineError, a lost replica: one 500 with the OpenAI body
        raise OpenAIError(500, f"generation failed: {_first_line(exc)}") from exc
    return outputs


def _sse_chunk(
    head: dict[str, Any], choices: list[dict], usage: dict | None, include_usage: bool
) -> str:
    """One SSE event of a streamed completion; ``usage`` is present (null until the end) only
    when the client asked for it."""
    body = {**head, "choices": choices}
    if include_usage:
        body["usage"] = usage
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    # RayTaskError strings carry a traceback; the last line is the original message.
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:500] if lines else type(exc).__name__
