"""Engine-side output handling: detokenize, apply stop strings, gather ``n`` samples."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from neuron_runtime.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from neuron_runtime.request import Request, RequestStatus
from neuron_runtime.sampling_params import SamplingParams
from neuron_runtime.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Sequence:
    index: int
    detokenizer: IncrementalDetokenizer | None
    stop: StopChecker | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    sent_text: int = 0  # chars of text already delivered (DELTA kind)
    sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: RequestOutputKind
    seqs: dict[str, _Sequence]
    arrival_time: float
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    error: str | None = None
    # Per prompt token: None for the first, then {token id: logprob} (when asked).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs.values())


class OutputProcessor:
    """Turns per-sequence token updates into per-request ``RequestOutput``s."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.num_aborted = 0  # requests aborted with a sequence still unfinished
        self.child_to_parent: dict[str, str] = {}

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_ids: list[str],
        kind: RequestOutputKind,
        prefilled: list[int] | None = None,
    ) -> None:
        """Registers a request's sequences.

        ``prefilled``: tokens of its one sequence that another engine produced and already
        returned (decode role). They count as output but are not delivered again; their
        logprobs belong to that engine's output, so their entries here are empty.
        """
        seqs = {}
        for index, child_id in enumerate(child_ids):
            detok = stop = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, params.skip_special_tokens
                )
                if params.stop:
                    stop = StopChecker(params.stop, params.include_stop_str_in_output)
            seq = _Sequence(index, detok, stop)
            if params.logprobs is not None:
                seq.logprobs = []
            if prefilled:
                self._mark_delivered(seq, prefilled)
            seqs[child_id] = seq
            self.child_to_parent[child_id] = request_id
        parent = _Parent(
            request_id, prompt, list(prompt_token_ids), params, kind, seqs, time.monotonic()
        )
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        self.parents[request_id] = parent

    def add_prompt_logprobs(self, entries: dict[str, list[dict[int, float]]]) -> None:
        """Appends a step's prompt logprobs (every child computes them; the first one counts)."""
        for child_id, chunk in entries.items():
            parent = self.parents.get(self.child_to_parent.get(child_id, ""))
            if parent is None or parent.prompt_logprobs is None:
                continue
            if parent.seqs[child_id].index == 0:
                parent.prompt_logprobs.extend(chunk)

    def process(
        self,
        updated: list[Request],
        logprobs: dict[str, dict[int, float]],
        draft_logprobs: dict[str, list[dict[int, float]]] | None = None,
    ) -> tuple[list[RequestOutput], list[str], list[str]]:
        """Returns the outputs to deliver, the child ids that a stop string ended and those
        whose processing raised (each of those ends with an error; the others go on).

        ``logprobs``: the entry of each request's sampled token; ``draft_logprobs``: those of
        the speculative drafts accepted before it. A stop string is looked for after each new
        token, and the tokens after the one completing it are dropped.
        """
        stopped: list[str] = []
        failed: list[str] = []
        touched: dict[str, _Parent] = {}
        now = time.monotonic()
        for request in updated:
            parent = self.parents[self.child_to_parent[request.req_id]]
            seq = parent.seqs[request.req_id]
            touched[parent.request_id] = parent
            try:
                self._process_one(request, parent, seq, now, logprobs, draft_logprobs, stopped)
            except Exception as exc:  # noqa: BLE001 - one request's failure is not the step's
                logger.warning("output of %s failed (%r): ending it", request.req_id, exc)
                request.status = RequestStatus.FINISHED_ERROR
                request.error = parent.error = f"output processing failed: {exc!r}"
                seq.finish_reason = request.finish_reason
                failed.append(request.req_id)
        outputs = [out for p in touched.values() if (out := self._output(p)) is not None]
        return outputs, stopped, failed

    def _process_one(
        self,
        request: Request,
        parent: _Parent,
        seq: _Sequence,
        now: float,
        logprobs: dict[str, dict[int, float]],
        draft_logprobs: dict[str, list[dict[int, float]]] | None,
        stopped: list[str],
    ) -> None:
        """One child's new tokens, text, stop strings and finish into its parent."""
        parent.num_cached_tokens = max(parent.num_cached_tokens, request.num_cached_tokens)
        if parent.first_token_time is None:
            parent.first_token_time = now
            parent.first_scheduled_time = request.first_scheduled_time
        if request.status == RequestStatus.FINISHED_ERROR:
            parent.error = request.error
        else:
            new_tokens = request.all_token_ids[request.num_prompt_tokens + len(seq.token_ids) :]
            entries: list[dict[int, float] | None] = [
                *(draft_logprobs or {}).get(request.req_id, []),
                logprobs.get(request.req_id),
            ]
            num_before = request.num_output_tokens - len(new_tokens)
            for i, token in enumerate(new_tokens):
                seq.token_ids.append(token)
                entry = entries[i] if i < len(entries) else None
                if seq.logprobs is not None and entry is not None:
                    seq.logprobs.append(entry)
                    seq.cumulative_logprob += entry[token]
                if seq.detokenizer is not None:
                    seq.text += seq.detokenizer.update([token])
                if seq.stop is not None and self._check_stop_strings(
                    request, seq, stopped, num_before + i + 1
                ):
                    break
        if request.status.finished:
            if seq.detokenizer is not None and seq.stop_reason is None:
                seq.text += seq.detokenizer.flush()
            seq.finish_reason = request.finish_reason
            if seq.stop_reason is None:
                seq.stop_reason = request.stop_reason

    @staticmethod
    def _mark_delivered(seq: _Sequence, token_ids: list[int]) -> None:
        seq.token_ids = list(token_ids)
        seq.sent_tokens = len(token_ids)
        if seq.logprobs is not None:
            seq.logprobs = [{} for _ in token_ids]
        if seq.detokenizer is not None:
            seq.text = seq.detokenizer.update(list(token_ids))
            seq.sent_text = len(seq.text)
        if seq.stop is not None:
            seq.stop.skip(seq.text)

    @staticmethod
    def _check_stop_strings(
        request: Request, seq: _Sequence, stopped: list[str], num_output_tokens: int
    ) -> bool:
        """Whether a stop string ended the sequence at its ``num_output_tokens``-th token."""
        assert seq.stop is not None
        if num_output_tokens <= request.params.min_tokens:
            seq.stop.skip(seq.text)  # text before min_tokens is out never stops the request
            return False
        cut = seq.stop.check(seq.text)
        if cut is None:
            return False
        seq.text, seq.stop_reason = cut
        if not request.status.finished:
            stopped.append(request.req_id)  # the engine still has to end it
        # Also when the same token hit max_tokens: the stop string explains the end.
        request.status = RequestStatus.FINISHED_STOPPED
        return True

    def abort(self, request_id: str) -> RequestOutput | None:
        """Marks every unfinished sequence of the request aborted; returns its final output."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        unfinished = [seq for seq in parent.seqs.values() if seq.finish_reason is None]
        for seq in unfinished:
            seq.finish_reason = "abort"
        self.num_aborted += bool(unfinished)
        return self._output(parent)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.seqs) if parent else []

    def _output(self, parent: _Parent) -> RequestOutput | None:
        finished = parent.finished
        if parent.kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for seq in parent.seqs.values():
            ready = len(seq.text)
            if seq.finish_reason is None and seq.stop is not None:
                ready = seq.stop.safe_length(seq.text)  # might still grow into a stop string
            first = seq.sent_tokens if parent.kind == RequestOutputKind.DELTA else 0
            if parent.kind == RequestOutputKind.DELTA:
                text = seq.text[seq.sent_text : max(ready, seq.sent_text)]
                seq.sent_text = max(ready, seq.sent_text)
                seq.sent_tokens = len(seq.token_ids)
            else:
                text = seq.text[:ready]
            completions.append(
                CompletionOutput(
                    seq.index,
                    text,
                    seq.token_ids[first:],
                    seq.finish_reason,
                    seq.stop_reason,
                    logprobs=None if seq.logprobs is None else seq.logprobs[first:],
                    cumulative_logprob=None if seq.logprobs is None else seq.cumulative_logprob,
                )
            )
        metrics = {"arrival_time": parent.arrival_time}
        if parent.first_token_time is not None:
            metrics["first_token_time"] = parent.first_token_time
        if parent.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = parent.first_scheduled_time
        prompt_logprobs = parent.prompt_logprobs
        if parent.kind == RequestOutputKind.DELTA:
            # Sent once, with the first output (the whole prompt has been computed by then).
            prompt_logprobs = None if parent.sent_prompt_logprobs else prompt_logprobs
            parent.sent_prompt_logprobs = True
        if finished:
            del self.parents[parent.request_id]
            for child_id in parent.seqs:
                del self.child_to_parent[child_id]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            error=parent.error,
            metrics=metrics,
            prompt_logprobs=prompt_logprobs,
        )
