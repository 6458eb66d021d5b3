"""The engine-side state of one sequence being generated."""

from __future__ import annotations

import enum
import time

from neuron_runtime.kv_transfer import KVImport
from neuron_runtime.multimodal import MultiModalInput
from neuron_runtime.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    # Prefill role: the first token is out and the KV exported; a decode engine goes on.
    FINISHED_HANDED_OFF = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_HANDED_OFF: "handoff",
}


class Request:
    """One sequence: its tokens, how many of them have KV in the cache, and its blocks.

    There is no prefill or decode phase: ``num_tokens - num_computed_tokens`` tokens still need
    a forward pass. A prompt has many, a decoding sequence one (the last sampled token).
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        mm_inputs: list[MultiModalInput] | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of the full blocks, in order
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        # Prefill role: hand the request off (export its KV) once its first token is out.
        self.export_kv = False
        # Prompt positions whose prompt logprobs were produced (a recompute skips them).
        self.num_prompt_logprobs = 0
        # bad_words as token id sequences (set by the engine, which has the tokenizer).
        self.bad_words_token_ids: list[list[int]] = []
        # Decode role: KV of the prompt computed elsewhere, taken when the request is admitted
        # (a payload written into its blocks, or a block read into them); dropped on
        # preemption: a preempted request recomputes.
        self.kv_import: KVImport | None = None
        # Images of the prompt, in prompt order, their features computed (kept for recompute).
        self.mm_inputs: list[MultiModalInput] = mm_inputs or []
        # Draft tokens proposed after the last token (spec_decode/): the next step feeds them
        # with it, and the target keeps those it accepts.
        self.spec_token_ids: list[int] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def max_tokens(self) -> int | None:
        return self.params.max_tokens

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def banned_token_ids(self) -> list[int]:
        """Tokens the next step must not sample: EOS and stop tokens until ``min_tokens`` are
        out, and the last token of every bad word whose other tokens end the output."""
        params = self.params
        banned = []
        if self.num_output_tokens < params.min_tokens:
            banned.extend(params.stop_token_ids)
            if self.eos_token_id is not None and not params.ignore_eos:
                banned.append(self.eos_token_id)
        if self.bad_words_token_ids:
            output = self.output_token_ids
            for word in self.bad_words_token_ids:
                prefix = word[:-1]
                if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
                    banned.append(word[-1])
        return banned

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """Applies token-level stop rules after a token was appended; True if finished."""
        params = self.params
        last = self.all_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == self.eos_token_id:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        if self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
