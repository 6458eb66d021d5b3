"""LLM: the offline API (``generate``, ``chat``, ``embed``), like ``vllm.LLM``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Literal, cast

from neuron_runtime.embedding import EmbeddingEngine, EmbeddingResult
from neuron_runtime.engine import LLMEngine, PromptType
from neuron_runtime.engine_args import EngineArgs
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
                self.engine.add_request(request_id, prompt, params, RequestOutputKind.FINAL_ONLY)
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
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them."""
        self._require_task("generate", "chat")
        conversations = cast(
            list[list[Message]],
            messages if messages and isinstance(messages[0], list) else [messages],
        )
        tokenizer = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tokenizer.encode_chat(conv)} for conv in conversations]
        return self.generate(prompts, sampling_params)

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
