"""SpecDecoder: proposes draft tokens for running requests and verifies them.

One engine step with speculation:

    step t:   target forward over [last token, d1 .. dk] (k + 1 rows of one slice)
              -> accept d1 .. da by the rule in rejection.py, emit one more token
              -> the scheduler keeps the KV of the accepted tokens, frees the rest's blocks
              -> the proposer drafts k tokens after the new last token (``propose``)
    step t+1: the scheduler budgets 1 + k tokens for the request, and so on.

Row i of a verify slice samples what follows the output plus the first i drafts, so
everything a row's distribution depends on must be known for each i:
- a grammar (structured outputs): the draft is cut at the first token the grammar rejects,
  and row i gets the grammar's bitmask after the first i drafts (the matcher advances through
  the draft and rolls back; the accepted tokens then advance it as any sampled token does);
  EOS is allowed exactly where the grammar accepts, as without speculation;
- stop strings: the output processor checks the text after each emitted token and drops
  the tokens after a stop string;
- logprobs: each emitted token's entry comes from its row's raw logits, as the sampler's.
Penalties, bad words and min_tokens not yet reached depend on the tokens before a position
in ways the target's rows do not carry (token counts, banned continuations, the EOS ban);
such requests, and prefill-role requests that hand their KV off, decode one token per step
in the same batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from neuron_runtime.config import EngineConfig
from neuron_runtime.kv_cache import KVCacheManager
from neuron_runtime.kv_transfer import DraftHidden
from neuron_runtime.request import Request, RequestStatus
from neuron_runtime.sampler import SamplingBatch, top_logprobs
from neuron_runtime.scheduler import SchedulerOutput
from neuron_runtime.spec_decode.metrics import SpecDecodeCounters, SpecDecodeStats
from neuron_runtime.spec_decode.ngram import NgramProposer
from neuron_runtime.spec_decode.rejection import accept_greedy, rejection_sample, target_probs
from neuron_runtime.structured_output import StructuredOutputManager, apply_token_bitmask

if TYPE_CHECKING:
    from neuron_runtime.model_runner import ModelRunner, ModelRunnerOutput, StepInputs

# Acceptance back-off: a request whose recent acceptance (an exponential average over its
# verify steps, from 1.0) falls below ``min_acceptance_rate`` skips steps, 8 the first time,
# twice as many each time in a row (at most 64); a verify step that accepts a draft resets it.
# While the average is below PROBE_RATE (the step before a pause: three failed steps in a row
# from a good average; and after a pause, when it restarts at ``min_acceptance_rate``) the
# request drafts a single token, a probe: a 2-row verify costs little more than a decode, so
# drafts that keep failing cost one extra row now and then, and an accepted probe lifts the
# average back to full drafts.
BACKOFF_STEPS = 8
MAX_BACKOFF_STEPS = 64
ACCEPTANCE_DECAY = 0.5
PROBE_RATE = 0.15


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

    def export_state(self, req_id: str) -> DraftHidden | None:
        """Prefill role: what a decode engine's proposer needs to draft after a handed-off
        prompt (EAGLE: the target's hidden states), or None; forgotten here."""
        ...

    def import_state(self, request: Request, state: DraftHidden) -> None:
        """Decode role: takes what ``export_state`` gave for a handed-off request."""
        ...

    def can_draft_on_arrival(self, request: Request) -> bool:
        """Whether it can draft for a handed-off request before the request's first target
        step here, while the prompt's KV may still be arriving."""
        ...


def speculates(request: Request) -> bool:
    """Whether each row of a verify slice can sample by its own rules (see above)."""
    p = request.params
    return (
        not p.has_penalties
        and not p.bad_words
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

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        kv: KVCacheManager,
        structured: StructuredOutputManager | None = None,
    ) -> None:
        spec = config.speculative
        assert spec is not None
        self.config = spec
        self.k = spec.num_speculative_tokens
        self.max_model_len = config.model.max_model_len
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.runner = runner
        self.kv = kv
        self.structured = structured  # grammar state of constrained requests
        self.proposer = build_proposer(config, runner)
        self.counters = SpecDecodeCounters(self.k)
        self._acceptance: dict[str, _Acceptance] = {}
        self._seen: set[str] = set()  # requests the proposer may hold state of
        # req_id -> logprobs entries of the drafts the last verify accepted (``take_logprobs``)
        self._draft_logprobs: dict[str, list[dict[int, float]]] = {}

    def stats(self) -> SpecDecodeStats:
        return self.counters.snapshot()

    def propose(self, running: list[Request]) -> None:
        """Sets ``spec_token_ids`` of the running requests that decode next step."""
        live = {r.req_id for r in running}
        for req_id in (self._seen | set(self._acceptance)) - live:
            self._acceptance.pop(req_id, None)
            self.proposer.release(req_id)
        self._seen = live
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        requests, counts = [], []
        for request in running:
            if not speculates(request):
                if not request.export_kv:  # a prefill-role request's state goes with it
                    self.proposer.release(request.req_id)  # it never drafts: keep no state
                continue
            if (
                request.status != RequestStatus.RUNNING
                or request.num_computed_tokens != request.num_tokens - 1
                or request.spec_token_ids  # drafted, not verified yet (it did not run)
                or self._backing_off(request.req_id)
            ):
                continue
            k = self._num_drafts(request)
            if k < 1:
                continue
            if self._probing(request.req_id):
                k = 1
            if self.proposer.needs_slots and not self.kv.allocate_slots(request, k + 1):
                continue  # no room to draft: this request decodes one token
            requests.append(request)
            counts.append(k)
        if not requests:
            return
        with torch.inference_mode():
            drafts = self.proposer.propose(requests, counts)
        for request, k, draft in zip(requests, counts, drafts, strict=True):
            draft = list(draft[:k])
            if self.structured is not None and request.params.structured_outputs is not None:
                # Tokens past one the grammar rejects could never be accepted.
                draft = draft[: self.structured.valid_draft_length(request.req_id, draft)]
            request.spec_token_ids = draft
            if self.proposer.needs_slots and len(draft) < k:
                self.kv.trim(request, request.num_tokens + len(draft))

    def _num_drafts(self, request: Request) -> int:
        max_tokens = request.max_tokens or self.max_model_len
        # The verify step emits up to k + 1 tokens and feeds positions up to num_tokens + k - 1.
        return min(
            self.k,
            max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens,
        )

    def export_state(self, req_id: str) -> DraftHidden | None:
        """Prefill role: the proposer's state a handed-off request takes along (KVHandoff)."""
        return self.proposer.export_state(req_id)

    def import_state(self, request: Request, state: DraftHidden) -> None:
        self.proposer.import_state(request, state)

    def release(self, req_id: str) -> None:
        """Forgets an aborted request (one that may never have run here)."""
        self._acceptance.pop(req_id, None)
        self.proposer.release(req_id)

    def propose_arrivals(self, scheduled: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Decode role: requests admitted in this step after a KV handoff draft already in it
        (their first slice here becomes a verify slice), where the proposer can draft before
        the prompt's KV is in (n-gram, a separate draft model, EAGLE from the handed-off
        hidden states) and the step's token budget has room."""
        limit = self.config.disable_by_batch_size
        running = sum(1 for r in requests.values() if r.status == RequestStatus.RUNNING)
        if limit is not None and running > limit:
            return
        room = self.max_num_batched_tokens - scheduled.num_batched_tokens
        arrivals, counts = [], []
        for seq in scheduled.seqs:
            request = requests[seq.req_id]
            if seq.kv_import is None or len(seq.token_ids) != 1 or seq.num_spec_tokens:
                continue
            if not speculates(request) or request.params.structured_outputs is not None:
                continue  # (a grammar's draft rows are masked in ``propose``)
            if not self.proposer.can_draft_on_arrival(request):
                continue
            k = min(self._num_drafts(request), room)
            if self._probing(request.req_id):
                k = min(k, 1)
            if k < 1 or not self.kv.allocate_slots(request, k + 1):
                continue
            room -= k
            arrivals.append((seq, request))
            counts.append(k)
        if not arrivals:
            return
        with torch.inference_mode():
            drafts = self.proposer.propose([r for _, r in arrivals], counts)
        for (seq, request), k, draft in zip(arrivals, counts, drafts, strict=True):
            draft = list(draft[:k])
            if len(draft) < k:
                self.kv.trim(request, request.num_tokens + len(draft))
            if not draft:
                continue
            request.spec_token_ids = draft
            seq.token_ids = seq.token_ids + draft
            seq.num_spec_tokens = len(draft)
            seq.block_table = list(request.block_table)
            scheduled.num_batched_tokens += len(draft)

    def _state(self, req_id: str) -> _Acceptance:
        return self._acceptance.setdefault(req_id, _Acceptance())

    def _probing(self, req_id: str) -> bool:
        """Whether the request drafts one token only (see PROBE_RATE; never with back-off
        off: ``min_acceptance_rate`` 0)."""
        return self.config.min_acceptance_rate > 0 and self._state(req_id).rate < PROBE_RATE

    def _backing_off(self, req_id: str) -> bool:
        state = self._state(req_id)
        if state.skip_steps > 0:
            state.skip_steps -= 1
            if state.skip_steps == 0:
                # Try again; one more step without acceptance backs off again.
                state.rate = self.config.min_acceptance_rate
            return True
        return False

    def _record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        self.counters.record(num_drafts, num_accepted)
        state = self._state(req_id)
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
        self._draft_logprobs = {}
        self._seen.update(seq.req_id for seq in step.seqs)
        if step.verify:
            self._verify(step, hidden, result)
        self.proposer.observe(step, hidden, result)

    def take_logprobs(self) -> dict[str, list[dict[int, float]]]:
        """req_id -> logprobs entries of the drafts the last step accepted, in order (the
        step's ``ModelRunnerOutput.logprobs`` has the entry of the token sampled after them)."""
        entries, self._draft_logprobs = self._draft_logprobs, {}
        return entries

    def _verify(self, step: StepInputs, hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        runner = self.runner
        rows: list[int] = []
        seqs = []
        # Constrained slices: each row has its own bitmask. Sampled ones mask every row here;
        # greedy ones only the rows whose argmax the grammar refuses (``_accept_greedy_grammar``).
        drafts: dict[str, list[int]] = {}
        for seq, first in step.verify:
            n = seq.num_spec_tokens + 1
            rows.extend(range(first, first + n))
            if seq.grammar_bitmask is not None:
                if not seq.params.greedy:
                    drafts[seq.req_id] = seq.token_ids[-seq.num_spec_tokens :]
                seq = dataclasses.replace(seq, grammar_bitmask=None)
            seqs.extend([seq] * n)
        verified = hidden[rows]  # [R, hidden]: the last token, then each draft
        nan_rows = torch.isnan(verified).any(dim=-1).tolist()
        raw = runner.model.compute_logits(verified)  # [R, V]
        logits = self._mask_grammar_rows(step, runner._process_logits(seqs, raw), drafts)
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
            if seq.params.greedy and seq.grammar_bitmask is not None:
                tokens = self._accept_greedy_grammar(
                    seq.req_id, logits[rows_of], argmax[rows_of], draft
                )
            elif seq.params.greedy:
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
            if seq.params.logprobs is not None:
                entries = logprob_entries(raw[rows_of][: len(tokens)], tokens, seq.params.logprobs)
                result.logprobs[seq.req_id] = entries[-1]
                self._draft_logprobs[seq.req_id] = entries[:-1]
            self._record(seq.req_id, len(draft), len(tokens) - 1)

    def _accept_greedy_grammar(
        self, req_id: str, logits: torch.Tensor, argmax: list[int], draft: list[int]
    ) -> list[int]:
        """``accept_greedy`` on grammar-masked rows, masking only where needed: the argmax of
        an unmasked row is the masked row's argmax whenever the grammar allows it there (it is
        the first maximum, and masking only lowers the others). logits: [k + 1, V] unmasked;
        the drafts are tokens the grammar accepts (``propose`` cut the rest)."""
        structured = self.structured
        assert structured is not None

        def choice(i: int) -> int:  # the masked argmax of row i
            if structured.allows(req_id, draft[:i], argmax[i]):
                return argmax[i]
            row = structured.draft_bitmasks({req_id: draft[:i]})[req_id][-1:]  # [1, W]
            return int(apply_token_bitmask(logits[i : i + 1], row.to(logits.device)).argmax())

        for i, token in enumerate(draft):
            chosen = choice(i)
            if chosen != token:
                return draft[:i] + [chosen]
        return draft + [choice(len(draft))]

    def _mask_grammar_rows(
        self, step: StepInputs, logits: torch.Tensor, drafts: dict[str, list[int]]
    ) -> torch.Tensor:
        """Masks each constrained slice's rows of ``logits`` [R, V] (the verify rows in
        ``step.verify`` order) with the grammar's bitmask after each prefix of its draft."""
        if not drafts:
            return logits
        assert self.structured is not None
        masks = self.structured.draft_bitmasks(drafts)  # req_id -> [k + 1, W]
        parts: list[torch.Tensor] = []
        rows: list[int] = []
        row = 0
        for seq, _ in step.verify:
            n = seq.num_spec_tokens + 1
            mask = masks.get(seq.req_id)
            if mask is not None:
                parts.append(mask)
                rows.extend(range(row, row + n))
            row += n
        if not parts:
            return logits
        bitmask = torch.cat(parts).to(logits.device)  # [rows, W]
        return apply_token_bitmask(logits, bitmask, torch.tensor(rows, device=logits.device))


def logprob_entries(
    logits: torch.Tensor, tokens: list[int], num_top: int
) -> list[dict[int, float]]:
    """Per emitted token, {token id: logprob} of the token and the top ``num_top`` tokens
    of the model's distribution at its row. logits: [len(tokens), V] raw logits."""
    token_t = torch.tensor(tokens, device=logits.device)
    chosen, top_ids, top_values = top_logprobs(logits, token_t, max(num_top, 1))
    entries = []
    for i, token in enumerate(tokens):
        entry = dict(
            zip(top_ids[i, :num_top].tolist(), top_values[i, :num_top].tolist(), strict=True)
        )
        entry[token] = float(chosen[i])
        entries.append(entry)
    return entries


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
