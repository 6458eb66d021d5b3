"""SpecDecoder: proposes draft tokens for running requests and verifies them.

One engine step with speculation:

    step t:   target forward over [last token, d1 .. dk] (k + 1 rows of one slice)
              -> accept d1 .. da by the rule in rejection.py, emit one more token
              -> the scheduler keeps the KV of the accepted tokens, frees the rest's blocks
              -> the proposer drafts k tokens after the new last token (``propose``)
    step t+1: the scheduler budgets 1 + k tokens for the request, and so on.

A request speculates only when each of its positions samples from the same rules: no
penalties, bad words, grammar, stop strings or logprobs, and min_tokens already reached
(those depend on the tokens before each position); the others decode one token at a time
in the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from neuron_runtime.config import EngineConfig
from neuron_runtime.kv_cache import KVCacheManager
from neuron_runtime.request import Request, RequestStatus
from neuron_runtime.sampler import SamplingBatch
from neuron_runtime.spec_decode.metrics import SpecDecodeCounters, SpecDecodeStats
from neuron_runtime.spec_decode.ngram import NgramProposer
from neuron_runtime.spec_decode.rejection import accept_greedy, rejection_sample, target_probs

if TYPE_CHECKING:
    from neuron_runtime.model_runner import ModelRunner, ModelRunnerOutput, StepInputs

# Acceptance back-off: a request whose recent acceptance (an exponential average over its
# verify steps) falls below ``min_acceptance_rate`` skips steps, 8 the first time, twice as
# many each time in a row (at most 64); a verify step that accepts a draft resets it.
BACKOFF_STEPS = 8
MAX_BACKOFF_STEPS = 64
ACCEPTANCE_DECAY = 0.5


class Proposer(Protocol):
    # True when drafting writes KV past the last token (a draft model, EAGLE): the proposer
    # then needs the request's slots for the k positions it drafts before it runs.
    needs_slots: bool

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Up to ``num_tokens[i]`` draft tokens after each request's last token."""
        ...

    def observe(self, step: StepInputs, hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        """Sees each target step's hidden states (EAGLE drafts from them)."""
        ...

    def release(self, req_id: str) -> None: ...


def speculates(request: Request) -> bool:
    """Whether every position of a verify slice samples under the same rules (see above)."""
    p = request.params
    return (
        p.logprobs is None
        and not p.has_penalties
        and not p.bad_words
        and not p.stop
        and p.structured_outputs is None
        and request.num_output_tokens >= p.min_tokens
        and not request.export_kv
    )


@dataclass
class _Acceptance:
    rate: float = 1.0
    skip_steps: int = 0
    next_backoff: int = BACKOFF_STEPS


class SpecDecoder:
    """Owns the proposer, verifies speculative slices and counts acceptance."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, kv: KVCacheManager) -> None:
        spec = config.speculative
        assert spec is not None
        self.config = spec
        self.k = spec.num_speculative_tokens
        self.max_model_len = config.model.max_model_len
        self.runner = runner
        self.kv = kv
        self.proposer = build_proposer(config, runner)
        self.counters = SpecDecodeCounters(self.k)
        self._acceptance: dict[str, _Acceptance] = {}

    def stats(self) -> SpecDecodeStats:
        return self.counters.snapshot()

    def propose(self, running: list[Request]) -> None:
        """Sets ``spec_token_ids`` of the running requests that decode next step."""
        live = {r.req_id for r in running}
        for req_id in [r for r in self._acceptance if r not in live]:
            del self._acceptance[req_id]
            self.proposer.release(req_id)
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        requests, counts = [], []
        for request in running:
            if not speculates(request):
                self.proposer.release(request.req_id)  # it never drafts: keep no state
                continue
            if (
                request.status != RequestStatus.RUNNING
                or request.num_computed_tokens != request.num_tokens - 1
                or self._backing_off(request.req_id)
            ):
                continue
            max_tokens = request.max_tokens or self.max_model_len
            # The verify step emits up to k + 1 tokens and feeds positions up to num_tokens + k - 1.
            k = min(
                self.k,
                max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens,
            )
            if k < 1:
                continue
            if self.proposer.needs_slots and not self.kv.allocate_slots(request, k + 1):
                continue  # no room to draft: this request decodes one token
            requests.append(request)
            counts.append(k)
        if not requests:
            return
        with torch.inference_mode():
            drafts = self.proposer.propose(requests, counts)
        for request, k, draft in zip(requests, counts, drafts, strict=True):
            request.spec_token_ids = list(draft[:k])
            if self.proposer.needs_slots and len(draft) < k:
                self.kv.trim(request, request.num_tokens + len(draft))

    def _backing_off(self, req_id: str) -> bool:
        state = self._acceptance.setdefault(req_id, _Acceptance())
        if state.skip_steps > 0:
            state.skip_steps -= 1
            if state.skip_steps == 0:
                # Try again; one more step without acceptance backs off again.
                state.rate = self.config.min_acceptance_rate
            return True
        return False

    def _record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        self.counters.record(num_drafts, num_accepted)
        state = self._acceptance.setdefault(req_id, _Acceptance())
        rate = num_accepted / num_drafts
        state.rate = ACCEPTANCE_DECAY * state.rate + (1 - ACCEPTANCE_DECAY) * rate
        if num_accepted:
            state.next_backoff = BACKOFF_STEPS
        elif state.rate < self.config.min_acceptance_rate:
            state.skip_steps = state.next_backoff
            state.next_backoff = min(2 * state.next_backoff, MAX_BACKOFF_STEPS)

    def after_forward(
        self, step: StepInputs, hidden: torch.Tensor, result: ModelRunnerOutput
    ) -> None:
        """Verifies the step's speculative slices (filling ``result``), then lets the proposer
        see the hidden states. hidden: [T, hidden] for every row of the step."""
        if step.verify:
            self._verify(step, hidden, result)
        self.proposer.observe(step, hidden, result)

    def _verify(self, step: StepInputs, hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        runner = self.runner
        rows: list[int] = []
        seqs = []
        for seq, first in step.verify:
            n = seq.num_spec_tokens + 1
            rows.extend(range(first, first + n))
            seqs.extend([seq] * n)
        verified = hidden[rows]  # [R, hidden]: the last token, then each draft
        nan_rows = torch.isnan(verified).any(dim=-1).tolist()
        logits = runner._process_logits(seqs, runner.model.compute_logits(verified))  # [R, V]
        argmax = logits.argmax(dim=-1).tolist()
        batch = runner._sampling_batch(seqs, logits.device)
        row = 0
        for seq, _ in step.verify:
            n = seq.num_spec_tokens + 1
            rows_of = slice(row, row + n)
            row += n
            draft = seq.token_ids[-seq.num_spec_tokens :]
            if any(nan_rows[rows_of]):
                result.failed[seq.req_id] = "the model produced NaN logits"
                continue
            if seq.params.greedy:
                tokens = accept_greedy(argmax[rows_of], draft)
            else:
                own = SamplingBatch(
                    temperature=batch.temperature[rows_of],
                    top_k=batch.top_k[rows_of],
                    top_p=batch.top_p[rows_of],
                    min_p=batch.min_p[rows_of],
                    generators=batch.generators[rows_of],
                )
                probs = target_probs(logits[rows_of], own)  # [k + 1, V]
                tokens = rejection_sample(probs, draft, own.generators[0])
            result.accepted[seq.req_id] = tokens[:-1]
            result.sampled[seq.req_id] = tokens[-1]
            self._record(seq.req_id, len(draft), len(tokens) - 1)


def build_proposer(config: EngineConfig, runner: ModelRunner) -> Proposer:
    spec = config.speculative
    assert spec is not None
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.lookup_min, spec.lookup_max)
    if spec.method == "draft_model":
        from neuron_runtime.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, runner)
    from neuron_runtime.spec_decode.eagle import EagleProposer

    return EagleProposer(config, runner)
