"""LLM: the offline API (``generate``, ``chat``), like ``vllm.LLM``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from neuron_runtime.engine import LLMEngine, PromptType
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.outputs import RequestOutput, RequestOutputKind
from neuron_runtime.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    """Generates for a batch of prompts at once, continuous batching under the hood.

    >>> llm = LLM(model="smollm2-135m-instruct")
    >>> llm.generate("The capital of France is", SamplingParams(max_tokens=8))
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **engine_args: Any) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):  # noqa: ANN201 - the Tokenizer wrapper
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order."""
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
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tokenizer.encode_chat(conv)} for conv in conversations]
        return self.generate(prompts, sampling_params)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(request_ids):
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("the engine went idle before every request finished")
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[r] for r in request_ids]
