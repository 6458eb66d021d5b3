"""Tokenizer wrapper, incremental (streaming) detokenization and stop-string matching."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

# How many prompt tokens the first decode window looks back; enough context for the first
# output token to decode as it would in the middle of the text (e.g. its leading space).
_PROMPT_CONTEXT_TOKENS = 5


class Tokenizer:
    """A Hugging Face fast tokenizer loaded from a local model folder."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from transformers import AutoTokenizer

        # Any: transformers annotates decode and friends with unions of every call form.
        self._hf: Any = AutoTokenizer.from_pretrained(path)
        # Added tokens flagged special are exactly what decode(skip_special_tokens=True) drops;
        # the named ones (bos, eos, pad, ...) are included for tokenizers that do not flag them.
        self.all_special_ids: set[int] = set(self._hf.all_special_ids) | {
            token_id for token_id, token in self._hf.added_tokens_decoder.items() if token.special
        }

    @property
    def eos_token_id(self) -> int | None:
        return self._hf.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._hf.bos_token_id

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer itself (grammar engines build their token tables from it)."""
        return self._hf

    @property
    def chat_template(self) -> str | None:
        """The chat template's Jinja source (None: the model has none)."""
        template = self._hf.chat_template
        return template if isinstance(template, str) else None

    @property
    def vocab_size(self) -> int:
        """Size of the full vocabulary, added tokens included."""
        return len(self._hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._hf.encode(text, add_special_tokens=add_special_tokens)

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each word's token ids as written and after a space (the spelling mid-sentence),
        without special tokens; duplicates removed."""
        seqs: list[list[int]] = []
        for word in words:
            for spelling in (word, " " + word.lstrip()):
                ids = self.encode(spelling, add_special_tokens=False)
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def encode_batch(self, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]:
        """Token ids of each text, special tokens added; cut to ``max_length`` (specials kept)."""
        truncate = max_length is not None
        return self._hf(list(texts), truncation=truncate, max_length=max_length)["input_ids"]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean_up_tokenization_spaces: it rewrites text across token boundaries (" ." -> "."),
        # which streaming cannot reproduce, and streamed and whole outputs must be identical.
        return self._hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self._hf.convert_ids_to_tokens(list(ids))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        """Render ``messages`` with the model's chat template (token ids if ``tokenize``)."""
        text = self._render_chat(messages, add_generation_prompt)
        return self._encode_rendered(text) if tokenize else text

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of the chat prompt (generation prompt appended), with BOS exactly once.

        ``tools`` (OpenAI function tools) go to the template as its ``tools`` variable.
        """
        return self._encode_rendered(self._render_chat(messages, True, tools))

    def _render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if not self._hf.chat_template:
            raise ValueError(
                "this model has no chat template; use a plain prompt instead of messages"
            )
        return self._hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def _encode_rendered(self, text: str) -> list[int]:
        # Templates that write the BOS token themselves would get a second one from the
        # tokenizer's post-processor; otherwise let the tokenizer add what it normally adds.
        bos = self._hf.bos_token
        template_has_bos = bos is not None and text.startswith(bos)
        return self.encode(text, add_special_tokens=not template_has_bos)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Each update decodes two short windows of ids: ``[prefix_offset, read_offset)`` (already
    emitted, giving context) and ``[prefix_offset, end)``; the new text is the difference. A
    delta ending in U+FFFD is held back: the token split a multi-byte UTF-8 character whose
    remaining bytes come with later tokens. The joined deltas plus ``flush()`` equal
    ``tokenizer.decode(output_ids)`` for byte-level tokenizers; for SentencePiece-style ones
    the first delta keeps the leading space the prompt context implies.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = [t for t in prompt_token_ids if self._keep(t)][-_PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)

    def update(self, new_token_ids: Iterable[int]) -> str:
        """Add generated tokens; return the text they complete (possibly empty)."""
        # Skipped special tokens decode to nothing, so drop them now and keep the window short.
        self._ids.extend(t for t in new_token_ids if self._keep(t))
        prefix_text, new_text = self._decode_windows()
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        return self._advance(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """Return any held-back text (an incomplete character decodes as U+FFFD) at the end."""
        prefix_text, new_text = self._decode_windows()
        return self._advance(new_text[len(prefix_text) :])

    def _keep(self, token_id: int) -> bool:
        return not (self.skip_special_tokens and token_id in self.tokenizer.all_special_ids)

    def _decode_windows(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip)
        return prefix_text, decode(self._ids[self._prefix_offset :], skip)

    def _advance(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Ids before the prefix window are never decoded again.
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return delta


class StopChecker:
    """Finds stop strings in a sequence's growing output text.

    Call ``check(text)`` after every update with the whole text so far (it only ever grows);
    only the part that could contain a new match is searched: the new text plus
    ``max_stop_len - 1`` characters before it, since a stop string may span token boundaries.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if not stop or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max(len(s) for s in self.stop)
        self._checked_len = 0

    def check(self, text: str) -> tuple[str, str] | None:
        """Return ``(truncated_text, stop_str)`` if a stop string appeared, else None.

        The text is cut before the stop string, or after it with include_stop_str_in_output.
        """
        start = max(0, self._checked_len - self._max_stop_len + 1)
        self._checked_len = len(text)
        best: tuple[int, str] | None = None
        for stop_str in self.stop:
            index = text.find(stop_str, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop_str)
        if best is None:
            return None
        index, stop_str = best
        end = index + len(stop_str) if self.include_stop_str_in_output else index
        return text[:end], stop_str

    def skip(self, text: str) -> None:
        """Marks ``text`` as searched without looking for stop strings in it."""
        self._checked_len = len(text)

    def safe_length(self, text: str) -> int:
        """How much of ``text`` may be streamed now.

        A tail that could still grow into a stop string is held back, because it would be cut
        if the stop string completes. With include_stop_str_in_output nothing is ever cut
        before a stop string, so everything is safe.
        """
        if self.include_stop_str_in_output:
            return len(text)
        for hold in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-hold:]
            if any(s.startswith(tail) for s in self.stop):
                return len(text) - hold
        return len(text)
