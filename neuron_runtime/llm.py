"""LLM: the offline API (``generate``, ``chat``, ``embed``), like ``vllm.LLM``."""

from __future__ import annotations

import base64
import binascii
import itertools
from collections.abc import Sequence
from typing import Any, Literal, cast

from neuron_runtime.embedding import EmbeddingEngine, EmbeddingResult
from neuron_runtime.engine import LLMEngine, PromptType
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.multimodal import MultiModalInput, hash_image, place_images
from neuron_runtime.outputs import RequestOutput, RequestOutputKind
from neuron_runtime.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    """Generates for a batch of prompts at once, continuous batching under the hood.

    >>> llm = LLM(model="smollm2-135m-instruct")
    >>> llm.generate("The capital of France is", SamplingParams(max_tokens=8))

    With ``task="embed"`` it wraps an EmbeddingEngine instead (``engine_args`` go to it):

    >>> LLM(model="all-minilm-l6-v2", task="embed").embed(["A cat."]).embeddings.shape
    (1, 384)

    A vision-language model takes images with a prompt, one ``<image>`` per image:

    >>> LLM(model="tiny-llava").generate({"prompt": "<image>What is this?",
    ...                                   "multi_modal_data": {"image": pil_image}})
    """

    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        task: Literal["generate", "embed"] = "generate",
        **engine_args: Any,
    ) -> None:
        if task not in ("generate", "embed"):
            raise ValueError(f"task must be 'generate' or 'embed', got {task!r}")
        self.task = task
        self._ids = itertools.count()
        if task == "embed":
            self.embedding_engine = EmbeddingEngine(model, **engine_args)
        else:
            self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))

    def get_tokenizer(self):  # noqa: ANN201 - the Tokenizer wrapper
        if self.task == "embed":
            return self.embedding_engine.tokenizer
        return self.engine.tokenizer

    def embed(
        self,
        texts: str | Sequence[str] | Sequence[Sequence[int]],
        normalize: bool = True,
        truncate: bool = False,
    ) -> EmbeddingResult:
        """One embedding row per text (or token id list), in input order."""
        self._require_task("embed", "embed")
        inputs = [texts] if isinstance(texts, str) else texts
        return self.embedding_engine.embed(inputs, normalize=normalize, truncate=truncate)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order."""
        self._require_task("generate", "generate")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif prompts and isinstance(prompts, list) and isinstance(prompts[0], int):
            prompts = [prompts]  # one prompt given as token ids
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts"
                )
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                request_id = str(next(self._ids))
                prompt, mm_inputs = self._with_images(prompt)
                self.engine.add_request(
                    request_id, prompt, params, RequestOutputKind.FINAL_ONLY, mm_inputs=mm_inputs
                )
                request_ids.append(request_id)
            return self._run(request_ids)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them;
        ``tools`` (OpenAI function tools) go to the template."""
        self._require_task("generate", "chat")
        conversations = cast(
            list[list[Message]],
            messages if messages and isinstance(messages[0], list) else [messages],
        )
        prompts = [self._chat_prompt(conv, tools) for conv in conversations]
        return self.generate(prompts, sampling_params)

    def _chat_prompt(
        self, conversation: list[Message], tools: list[dict[str, Any]] | None = None
    ) -> dict:
        """Token ids of the rendered chat; image content parts become image placeholders
        (``{"type": "image"}`` for the template) and their images ``multi_modal_data``."""
        images: list[Any] = []
        messages = []
        for message in conversation:
            content = message.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    image = _part_image(part)
                    if image is not None:
                        images.append(image)
                        part = {"type": "image"}
                    parts.append(part)
                message = {**message, "content": parts}
            messages.append(message)
        prompt: dict = {"prompt_token_ids": self.engine.tokenizer.encode_chat(messages, tools)}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        return prompt

    def _with_images(self, prompt: PromptType) -> tuple[PromptType, list[MultiModalInput] | None]:
        """A prompt with ``multi_modal_data`` -> its expanded token ids and image inputs."""
        if not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
            return prompt, None
        data = prompt["multi_modal_data"]
        if set(data) - {"image"}:
            raise ValueError(f"multi_modal_data takes only 'image', got {sorted(data)}")
        images = data.get("image")
        images = images if isinstance(images, list) else [images]
        vision = self.engine.vision
        if vision is None:
            raise ValueError(f"model {self.engine.config.model.name!r} has no vision tower")
        if "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
        else:
            ids = self.engine.tokenizer.encode(prompt["prompt"])
        ids, spans = place_images(ids, vision.image_token_id, vision.tokens_per_image, len(images))
        mm_inputs = [
            MultiModalInput(offset, length, hash_image(image), image=image)
            for (offset, length), image in zip(spans, images, strict=True)
        ]
        return {"prompt": prompt.get("prompt"), "prompt_token_ids": ids}, mm_inputs

    def _require_task(self, task: str, method: str) -> None:
        if self.task != task:
            raise ValueError(
                f"LLM.{method}() needs an LLM built with task={task!r}; this one has "
                f"task={self.task!r}"
            )

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(request_ids):
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("the engine went idle before every request finished")
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[r] for r in request_ids]


def _part_image(part: dict) -> Any:
    """The image of an image content part (bytes of a data: URL, or a PIL image), else None."""
    if part.get("type") == "image":
        return part["image"]
    if part.get("type") == "image_url":
        url = part["image_url"]
        return _data_url_bytes(url["url"] if isinstance(url, dict) else url)
    return None


def _data_url_bytes(url: str) -> bytes:
    """The image bytes of a base64 ``data:`` URL (the offline API fetches nothing)."""
    header, _, data = url.partition(",")
    if not header.startswith("data:") or not header.endswith(";base64"):
        raise ValueError("LLM.chat takes image_url parts as base64 data: URLs only")
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error:
        raise ValueError("the image data: URL is not valid base64") from None
