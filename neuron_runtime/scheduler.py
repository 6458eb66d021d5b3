"""Token-budget continuous batching with chunked prefill and preemption by recompute."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from neuron_runtime.config import SchedulerConfig
from neuron_runtime.kv_cache import KVCacheManager
from neuron_runtime.kv_transfer import KVImport
from neuron_runtime.multimodal import MultiModalInput, images_overlapping
from neuron_runtime.request import Request, RequestStatus
from neuron_runtime.sampling_params import SamplingParams
from neuron_runtime.structured_output import StructuredOutputManager
from neuron_runtime.structured_output.bitmask import BitmaskRow


@dataclass
class ScheduledSeq:
    """One request's slice of a step: feed ``token_ids`` at positions from ``start_pos``."""

    req_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    # True when this slice ends at the request's last known token, so a new token is sampled.
    sample: bool
    params: SamplingParams
    # Tokens the sampler must not pick (EOS and stop tokens until min_tokens are out).
    banned_token_ids: list[int] = field(default_factory=list)
    # The tokens penalties look at; filled only when the params carry a penalty.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt logprobs: rows from ``prompt_logprob_offset`` on predict these prompt tokens.
    prompt_logprob_targets: list[int] = field(default_factory=list)
    prompt_logprob_offset: int = 0
    # KV of the first ``kv_import.metadata.num_tokens`` tokens, there before this slice runs
    # (the engine starts a block read and holds the slice back until it lands).
    kv_import: KVImport | None = None
    # Images with placeholders inside this slice (whole inputs; the runner cuts their rows).
    mm_inputs: list[MultiModalInput] = field(default_factory=list)
    # Grammar-constrained sampling slice: the tokens the grammar allows next, a
    # [ceil(vocab / 32)] int32 bitmask row, filled while the step runs (structured_output/).
    grammar_bitmask: BitmaskRow | None = None
    # The last ``num_spec_tokens`` of ``token_ids`` are draft tokens to verify (spec_decode/):
    # every position from the request's last token on is sampled.
    num_spec_tokens: int = 0


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Decides which tokens of which requests run in the next forward pass.

    There is no prefill or decode phase, only a token budget: every request asks for
    ``num_tokens - num_computed_tokens`` tokens. Running requests are served first (oldest
    first); waiting ones are admitted while budget, sequence slots and KV blocks last. When a
    running request cannot get a block, the newest running request is preempted: its blocks
    are freed and it restarts from its prompt plus the tokens it already produced.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        structured: StructuredOutputManager | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # leader req_id -> forks of its prompt waiting for the leader's prompt KV
        self.held_forks: dict[str, list[Request]] = {}
        self.num_preemptions = 0
        # Grammar state of constrained requests; they wait until their grammar compiled.
        self.structured = structured
        self._grammar_failed: list[Request] = []  # reported by the next update()

    def add_request(self, request: Request, fork_of: str | None = None) -> None:
        """Queues a request. A fork (``fork_of``: another sample of the same prompt) waits
        until that request's prompt is computed, then shares its full prompt blocks through
        the prefix cache; only the partial last block is computed again for each fork."""
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        self.requests[request.req_id] = request
        if request.params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("structured_outputs needs an engine with a grammar compiler")
            self.structured.add(request.req_id, request.params.structured_outputs)
        shareable = self.kv.enable_prefix_caching and request.params.prompt_logprobs is None
        if fork_of is not None and shareable and fork_of in self.requests:
            self.held_forks.setdefault(fork_of, []).append(request)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.held_forks)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(forks) for forks in self.held_forks.values())

    def _release_forks(self, leader_id: str) -> None:
        # Ahead of later arrivals: the forks arrived with their leader.
        self.waiting.extendleft(reversed(self.held_forks.pop(leader_id, [])))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_spec = len(request.spec_token_ids)
            num_new = min(request.num_tokens + num_spec - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.append(victim.req_id)
                if victim is request:
                    break
            else:
                budget -= num_new
                out.seqs.append(self._slice(request, num_new))
                i += 1
                continue
            break  # the request preempted itself: nothing else can fit either

        compiling: list[Request] = []  # passed over: their grammar is not ready yet
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self._grammar_ready(request):
                if not request.status.finished:  # else the grammar failed and ended it
                    compiling.append(self.waiting.popleft())
                continue
            if request.kv_import is not None:
                # Imported KV counts as computed: only the tokens after it need a forward pass.
                request.num_computed_tokens = request.kv_import.metadata.num_tokens
            elif request.params.prompt_logprobs is not None:
                request.num_computed_tokens = 0  # every prompt position needs its logits
            else:
                request.num_cached_tokens = self.kv.match_prefix(request)
                request.num_computed_tokens = request.num_cached_tokens
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget and self.config.enable_chunked_prefill:
                num_new = budget
            if num_new > budget or not self.kv.allocate_slots(request, num_new):
                # A waiting request holds no blocks: keeping its prefix hits would pin memory
                # that running requests (or the request itself, once preempted) need.
                self.kv.free(request)
                request.num_cached_tokens = request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq = self._slice(request, num_new)
            if request.kv_import is not None:
                seq.kv_import, request.kv_import = request.kv_import, None
            else:
                self.kv.record_admission(request.num_tokens, request.num_cached_tokens)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            budget -= num_new
            out.seqs.append(seq)

        self.waiting.extendleft(reversed(compiling))
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        if self.structured is not None:
            sampling = [s for s in out.seqs if s.sample]
            rows = self.structured.bitmask([s.req_id for s in sampling])
            for seq in sampling:
                seq.grammar_bitmask = rows.get(seq.req_id)
            if not out.seqs and compiling:
                self.structured.wait_for_compiles(0.01)
        return out

    def _grammar_ready(self, request: Request) -> bool:
        """True when the request may run; a grammar that failed ends it with an error."""
        if self.structured is None:
            return True
        ready, error = self.structured.status(request.req_id, request.output_token_ids)
        if error is not None:
            request.error = error
            self.finish(request.req_id, RequestStatus.FINISHED_ERROR)
            self._grammar_failed.append(request)
        return ready

    def _slice(self, request: Request, num_new: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        end = start + num_new
        penalized = request.params.has_penalties
        targets: list[int] = []
        offset = 0
        if request.params.prompt_logprobs is not None:
            # Position p predicts prompt token p + 1; earlier chunks already produced some.
            first = max(start, request.num_prompt_logprobs)
            offset = first - start
            targets = request.prompt_token_ids[first + 1 : min(end + 1, request.num_prompt_tokens)]
            request.num_prompt_logprobs = first + len(targets)
        return ScheduledSeq(
            req_id=request.req_id,
            token_ids=(request.all_token_ids + request.spec_token_ids)[start:end]
            if request.spec_token_ids
            else request.all_token_ids[start:end],
            start_pos=start,
            block_table=list(request.block_table),
            sample=end >= request.num_tokens,
            params=request.params,
            banned_token_ids=request.banned_token_ids(),
            prompt_token_ids=request.prompt_token_ids if penalized else [],
            output_token_ids=request.output_token_ids if penalized else [],
            prompt_logprob_targets=targets,
            prompt_logprob_offset=offset,
            mm_inputs=images_overlapping(request.mm_inputs, start, end),
            num_spec_tokens=max(0, end - request.num_tokens),
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(
        self,
        output: SchedulerOutput,
        sampled: dict[str, int],
        failed: dict[str, str],
        accepted: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Advances requests by the step's tokens; returns those that got a token or failed.

        ``sampled`` maps req_id -> new token for each slice that sampled; ``failed`` maps
        req_id -> error for rows the model could not produce (those requests end with an error).
        ``accepted`` maps req_id -> the draft tokens the target accepted (speculative slices),
        which come before that slice's sampled token; rejected drafts' KV is left past
        ``num_computed_tokens`` (the next step overwrites it) and their blocks are freed.
        """
        updated, self._grammar_failed = self._grammar_failed, []
        for seq in output.seqs:
            request = self.requests.get(seq.req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if seq.req_id in failed:
                request.error = failed[seq.req_id]
                self.finish(seq.req_id, RequestStatus.FINISHED_ERROR)
                updated.append(request)
                continue
            request.num_computed_tokens += len(seq.token_ids) - seq.num_spec_tokens
            request.spec_token_ids = []
            self.kv.cache_full_blocks(request)
            if request.req_id in self.held_forks and seq.sample:
                self._release_forks(request.req_id)
            token = sampled.get(seq.req_id)
            if token is None:
                continue
            updated.append(request)
            drafts = accepted.get(seq.req_id, []) if accepted else []
            for i, new_token in enumerate([*drafts, token]):
                request.append_token(new_token)
                if i < len(drafts):  # an accepted draft: its KV is computed
                    request.num_computed_tokens += 1
                    self.kv.cache_full_blocks(request)
                if self.structured is not None and not self.structured.accept(
                    request.req_id, new_token
                ):
                    request.error = "no token the grammar allows was left to sample"
                    self.finish(request.req_id, RequestStatus.FINISHED_ERROR)
                    break
                if request.check_stop(self.max_model_len):
                    self.finish(request.req_id, request.status)
                    break
            else:
                if seq.num_spec_tokens:
                    self.kv.trim(request, request.num_tokens)
        return updated

    def finish(self, req_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (stopped, length, aborted or failed) and frees its blocks."""
        request = self.requests.pop(req_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            for forks in self.held_forks.values():
                if request in forks:
                    forks.remove(request)
        self._release_forks(req_id)
        request.status = status
        self.kv.free(request)
        if self.structured is not None:
            self.structured.release(req_id)
        return request
