"""The text side of a generated sequence: incremental detokenization, stop strings, logprobs.

The LLM deployment streams token ids; each of the ``n`` sequences of a request gets one
SequenceText that turns them into text deltas that are safe to send (never text that a stop
string completing later would cut away).
"""

from __future__ import annotations

from typing import Any

from deployments.protocol import SeqDelta
from neuron_runtime.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

TokenLogprobs = tuple[int, dict[int, float]]  # (sampled token id, {token id: logprob})


class SequenceText:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.min_tokens = min_tokens
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stop = StopChecker(stop, include_stop_str_in_output) if stop else None
        self.text = ""
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._sent = 0
        self._logprobs: list[TokenLogprobs] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: SeqDelta) -> None:
        """Takes the engine's new tokens; a stop string found here finishes the sequence."""
        if self.finished:
            return  # the engine ran on past a stop string: ignore the extra tokens
        self.num_tokens += len(delta.token_ids)
        if delta.logprobs:
            self._logprobs.extend(zip(delta.token_ids, delta.logprobs, strict=True))
        self.text += self.detokenizer.update(delta.token_ids)
        if delta.finish_reason is not None:
            self.text += self.detokenizer.flush()
        if self.stop is not None:
            cut = self.stop.check(self.text)
            # As in vLLM, stop strings count only once more than min_tokens tokens are out.
            if cut is not None and self.num_tokens > self.min_tokens:
                self.text, self.stop_reason = cut
                self.finish_reason = "stop"
                return
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason

    def take(self) -> tuple[str, list[TokenLogprobs]]:
        """The text and token logprobs not yet sent that may be sent now."""
        ready = len(self.text)
        if not self.finished and self.stop is not None:
            ready = self.stop.safe_length(self.text)
        start, self._sent = self._sent, max(self._sent, ready)
        logprobs, self._logprobs = self._logprobs, []
        return self.text[start : self._sent], logprobs


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def top_entries(entry: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    """The ``num_top`` most likely tokens of an entry (which also holds the sampled one)."""
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:num_top]


def chat_logprobs(tokenizer: Tokenizer, items: list[TokenLogprobs], num_top: int) -> list[dict]:
    """OpenAI chat ``logprobs.content`` entries."""

    def one(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [
        {
            **one(token_id, entry[token_id]),
            "top_logprobs": [one(t, lp) for t, lp in top_entries(entry, num_top)],
        }
        for token_id, entry in items
    ]


def prompt_logprobs(
    tokenizer: Tokenizer, entries: list[dict[int, float] | None] | None, num_top: int
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else {token id:
    {logprob, rank, decoded_token}} for the top ``num_top`` and the prompt's own token."""
    if entries is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)
        ranks = {token_id: rank for rank, (token_id, _) in enumerate(ranked[:num_top], 1)}
        out.append(
            {
                str(token_id): {
                    "logprob": logprob,
                    "rank": ranks.get(token_id),  # None: outside the top num_top
                    "decoded_token": token_text(tokenizer, token_id),
                }
                for token_id, logprob in entry.items()
            }
        )
    return out


def completion_logprobs(
    tokenizer: Tokenizer, items: list[TokenLogprobs], num_top: int, text_offset: int
) -> dict:
    """OpenAI legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs, offsets)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in items:
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(entry[token_id])
        tops.append({token_text(tokenizer, t): lp for t, lp in top_entries(entry, num_top)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
