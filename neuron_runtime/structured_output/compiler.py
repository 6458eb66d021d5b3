"""Grammar compilation with llguidance, off the engine loop, cached by content.

A compiled grammar is a matcher in its start state; each request gets a copy (~10 us). The
compiler runs on one worker thread (llguidance drops the GIL while it builds a grammar), so
the engine loop keeps stepping while a grammar compiles. llguidance's parser limits bound
the work a grammar may take (its size, the lexer's fuel at build time and per token), and
the caller bounds the wall time with ``timeout_s`` from the moment the compile starts: a
grammar that is not ready in time is refused (the ones queued behind it keep their own
allowance).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from neuron_runtime.structured_output.params import StructuredOutputsParams

# Whitespace allowed between JSON tokens unless the request says otherwise: a space, or one
# line break and an indent. Unbounded whitespace lets a small model sampling at high
# temperature spend max_tokens on blank lines.
JSON_WHITESPACE = r"(?:[ ]?|\n[ \t]{0,16})"


class GrammarError(ValueError):
    """The grammar or schema is invalid, or too large or too slow to compile."""


class CompileJob:
    """A grammar being compiled (or compiled): its future and when the worker started it."""

    def __init__(self) -> None:
        self.future: Future[CompiledGrammar] = Future()
        self.started_at: float | None = None

    def run(self, compile_fn: Callable[[], CompiledGrammar]) -> None:
        self.started_at = time.monotonic()
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(compile_fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for it
            self.future.set_exception(exc)


class CompiledGrammar:
    """A grammar ready to constrain requests: ``matcher()`` gives each one its own state."""

    def __init__(self, template: Any) -> None:
        self._template = template  # llguidance.LLMatcher in its start state, never advanced

    def matcher(self) -> Any:
        return self._template.deep_copy()


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``params``; GrammarError when the source does not parse."""
    import llguidance
    from llguidance import LLMatcher

    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
            if not params.disable_any_whitespace:
                options["whitespace_pattern"] = params.whitespace_pattern or JSON_WHITESPACE
            schema = params.json if kind == "json" else {"type": "object"}
            return LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
        if kind == "regex":
            return LLMatcher.grammar_from_regex(str(params.regex))
        if kind == "choice":
            return llguidance.grammar_from("choice", list(params.choice or ()))  # type: ignore[arg-type]
        return llguidance.grammar_from("grammar", str(params.grammar))
    except ValueError as exc:
        raise GrammarError(f"invalid {kind}: {exc}") from None


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer; results are cached by content.

    ``hf_tokenizer`` is a transformers fast tokenizer; its token table is built into
    llguidance's form on the first compile (about half a second), on the worker thread.
    ``vocab_size`` is the width of the model's logits: tokens past the tokenizer's own
    vocabulary are never allowed.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_id: int | None,
        timeout_s: float = 10.0,
        cache_size: int = 256,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, CompileJob] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")

    def submit(self, params: StructuredOutputsParams) -> CompileJob:
        """The compiled grammar, now (cached) or later (compiling on the worker thread).

        The job's future raises GrammarError for a grammar that cannot be used.
        """
        key = params.key
        with self._lock:
            job = self._cache.get(key)
            if job is not None and not job.future.cancelled():
                self._cache.move_to_end(key)
                return job
            job = CompileJob()
            self._pool.submit(job.run, lambda: self.compile(params))
            self._cache[key] = job
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return job

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compiles on the calling thread (uncached); GrammarError when it cannot."""
        from llguidance import LLMatcher, LLParserLimits

        text = grammar_text(params)
        # Errors without the parser's internal state: they go back to clients.
        limits = LLParserLimits(verbose_errors=False)
        matcher = LLMatcher(self.ll_tokenizer(), text, log_level=0, limits=limits)
        if matcher.is_error():
            raise GrammarError(f"invalid {params.kind}: {matcher.get_error()}")
        return CompiledGrammar(matcher)

    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id
                )
            return self._ll_tokenizer

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
