"""Per-request grammar state for the scheduler: compile status, matcher, batch bitmask.

Lifecycle of a constrained request:

    add()       compile starts on the worker thread (or hits the cache)
    status()    the scheduler admits the request once its grammar is ready; the matcher
                is created then and consumes the output tokens the request already has
                (a KV handoff's first token, or tokens kept across a preemption)
    bitmask()   before each step: one bitmask row per constrained request that samples,
                filled on the fill thread while the step's forward pass runs, or on demand
                (``fill_ahead=False``: the forward pass takes every core; most greedy rows
                then need no mask at all, see bitmask.py)
    accept()    after each step: the sampled token advances the matcher
    release()   when the request ends, whatever the reason

A fill reads the matchers of its batch: every call that creates, advances or drops a matcher
(status, accept, release, the next bitmask) first waits for the running fill to end, so a
matcher is never read and changed at once. llguidance releases the GIL while it fills, so
the fill overlaps the forward pass where a core is free. Where none is, the fill thread only
slows the forward pass down by as much as it fills (measured by bench/structured.py), so the
engine fills on demand there: a row is filled, on the engine thread, when the sampler needs it
(before the matchers change: the runner samples before the scheduler accepts).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from neuron_runtime.structured_output.bitmask import BitmaskRow
from neuron_runtime.structured_output.compiler import CompileJob, GrammarCompiler

if TYPE_CHECKING:
    import torch


@dataclass
class _GrammarState:
    job: CompileJob
    matcher: Any = None  # llguidance.LLMatcher once the grammar is ready
    num_consumed: int = 0  # output tokens the matcher has consumed


class StructuredOutputManager:
    """Grammar state of the constrained requests of one engine, keyed by request id."""

    def __init__(self, compiler: GrammarCompiler, fill_ahead: bool = True) -> None:
        self.compiler = compiler
        self.fill_ahead = fill_ahead  # False: each row fills when first needed
        self.states: dict[str, _GrammarState] = {}
        self._executor: Any = None  # llguidance.LLExecutor, made with the first bitmask
        self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-bitmask")
        self._filling: Future[None] | None = None  # the last step's fill

    def add(self, req_id: str, params: Any) -> None:
        """Starts compiling the request's grammar (``params``: StructuredOutputsParams)."""
        self.states[req_id] = _GrammarState(self.compiler.submit(params))

    def status(self, req_id: str, output_token_ids: list[int]) -> tuple[bool, str | None]:
        """(ready, error) for a request; unconstrained requests are always ready.

        On the first call after its grammar compiled, the request's matcher is created and
        consumes ``output_token_ids`` (tokens another engine or an earlier run produced).
        """
        state = self.states.get(req_id)
        if state is None:
            return True, None
        self._wait_for_fill()
        if state.matcher is None:
            future, started = state.job.future, state.job.started_at
            if not future.done():
                timeout = self.compiler.timeout_s
                if started is not None and time.monotonic() - started > timeout:
                    return False, f"the grammar did not compile within {timeout:g} s"
                return False, None
            exc = future.exception()
            if exc is not None:
                return False, str(exc)
            state.matcher = future.result().matcher()
        pending = output_token_ids[state.num_consumed :]
        if pending and not state.matcher.consume_tokens(pending):
            return False, "the tokens produced so far do not match the grammar"
        state.num_consumed = len(output_token_ids)
        return True, None

    def accept(self, req_id: str, token_id: int) -> bool:
        """Advances the request's matcher by its new token; False if the grammar rejects it
        (every allowed token had a -inf logit, e.g. banned by another parameter)."""
        state = self.states.get(req_id)
        if state is None:
            return True
        self._wait_for_fill()
        state.num_consumed += 1
        return bool(state.matcher.consume_token(token_id))

    def valid_draft_length(self, req_id: str, draft: list[int]) -> int:
        """How many leading tokens of a speculative ``draft`` the request's grammar accepts
        after its output so far (all of them when unconstrained); the matcher is unchanged."""
        state = self.states.get(req_id)
        if state is None:
            return len(draft)
        self._wait_for_fill()
        if state.matcher is None:
            return 0
        return int(state.matcher.validate_tokens(draft))

    def draft_bitmasks(self, drafts: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Bitmask rows for verifying speculative drafts: for each constrained request in
        ``drafts`` (req_id -> k draft tokens the grammar accepts, see ``valid_draft_length``),
        [k + 1, ceil(V / 32)] int32 whose row i allows what may follow the output plus the
        first i drafts. Computed now on the calling thread; each matcher advances through its
        draft and rolls back, so it ends where it began."""
        constrained = [(r, d) for r, d in drafts.items() if r in self.states]
        if not constrained:
            return {}
        # Imported only now: llguidance.torch's first import takes seconds (torch's compiler
        # stack), which an engine without constrained requests never pays.
        import llguidance
        import llguidance.torch

        self._wait_for_fill()
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=1)
        num_rows = sum(len(d) + 1 for _, d in constrained)
        bitmask = llguidance.torch.allocate_token_bitmask(num_rows, self.compiler.vocab_size)
        first, jobs, plain, rows = 0, [], [], {}
        for req_id, draft in constrained:
            matcher = self.states[req_id].matcher
            if draft:
                jobs.append((matcher, first, list(draft)))
            else:  # llguidance's draft fill takes at least one draft token
                plain.append((matcher, first))
            rows[req_id] = bitmask[first : first + len(draft) + 1]
            first += len(draft) + 1
        if jobs:
            llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, jobs, bitmask
            )
        if plain:
            llguidance.torch.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        return rows

    def allows(self, req_id: str, prefix: list[int], token: int) -> bool:
        """Whether the grammar takes ``token`` after the output plus ``prefix`` (tokens it
        accepts); the matcher is unchanged. It may refuse a token the bitmask allows (EOS once
        the grammar has stopped), never the reverse: a refusal means "mask the row"."""
        state = self.states[req_id]
        self._wait_for_fill()
        return int(state.matcher.validate_tokens([*prefix, token])) == len(prefix) + 1

    def bitmask(self, req_ids: list[str]) -> dict[str, BitmaskRow]:
        """The allowed tokens of each constrained request among ``req_ids`` (the requests
        that sample this step): a row each of one [R, ceil(V / 32)] int32 batch, which the
        fill thread fills while this returns at once (``BitmaskRow.get`` waits for it), or,
        without ``fill_ahead``, which each row's first ``get`` fills."""
        constrained = [r for r in req_ids if r in self.states]
        if not constrained:
            return {}
        import llguidance  # only now, as in draft_bitmasks
        import llguidance.torch

        self._wait_for_fill()
        bitmask = llguidance.torch.allocate_token_bitmask(
            len(constrained), self.compiler.vocab_size
        )  # [R, ceil(V / 32)] int32
        if not self.fill_ahead:
            return {
                r: BitmaskRow(bitmask, i, Future(), self.states[r].matcher)
                for i, r in enumerate(constrained)
            }
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=1)
        matchers = [(self.states[r].matcher, i) for i, r in enumerate(constrained)]
        filled = self._fill_thread.submit(
            llguidance.torch.fill_next_token_bitmask_par, self._executor, matchers, bitmask
        )
        self._filling = filled
        return {r: BitmaskRow(bitmask, i, filled) for i, r in enumerate(constrained)}

    def release(self, req_id: str) -> None:
        if req_id in self.states:
            self._wait_for_fill()
            del self.states[req_id]

    def _wait_for_fill(self) -> None:
        """Waits until the last fill ended (its error, if any, reaches the sampler)."""
        if self._filling is not None:
            wait([self._filling])
            self._filling = None

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Blocks until a pending compile finishes or ``timeout_s`` passes (an idle engine
        waits here instead of stepping in a loop)."""
        pending = [s.job.future for s in self.states.values() if s.matcher is None]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    @property
    def num_states(self) -> int:
        return len(self.states)

    @property
    def num_compiling(self) -> int:
        return sum(1 for s in self.states.values() if not s.job.future.done())
