"""Online validation: a share of live requests' prompt logits re-checked against transformers.

For a sampled request the engine keeps the raw logits its first token was sampled from (the
prompt's last position; ``ModelRunner.prompt_logit_taps``) and hands them here with the
prompt's token ids. A background thread holding transformers' implementation of the same
checkpoint (``teacher.Reference``) scores the prompt off the serving path and compares the two
rows with ``metrics.compare_logits`` under the reference dtype's tolerance. The engine loop
only copies one ``[vocab]`` row and puts it on a bounded queue: when the queue is full the
check is dropped and counted, never waited for.

The thread runs on torch's intra-op threads, which are the process's (``torch.set_num_threads``
from any thread resizes them for all): an engine replica on the CPU backend keeps torch at one
thread, its fused kernels having their own pool, so the reference takes one core at most, and
at the lowest CPU priority (a per-thread nice value on Linux): it runs on what the engine
leaves idle.

Not sampled: requests with images (the reference would need the pixels too) and requests that
go on after tokens produced elsewhere (a decode replica's KV handoff, a migrated request): no
engine there computes the logits at the prompt's last position.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from neuron_runtime.accuracy.metrics import TOLERANCES, Tolerance, compare_logits

if TYPE_CHECKING:
    from neuron_runtime.engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OnlineValidationConfig:
    """``accuracy`` in the app config: which share of requests is checked, and how strictly.

    ``dtype`` is the reference's (and picks the default bounds, ``metrics.TOLERANCES``);
    ``atol``, ``rtol``, ``kl`` and ``topk`` replace those bounds one by one. ``max_queue``
    checks wait for the worker at most; more are dropped. ``seed`` fixes the sampling draws.
    """

    sample_rate: float = 0.0
    dtype: str = "float32"
    atol: float | None = None
    rtol: float | None = None
    kl: float | None = None
    topk: float | None = None
    top_k: int = 5
    max_queue: int = 4
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"accuracy.sample_rate must be in [0, 1], got {self.sample_rate}")
        if self.dtype not in TOLERANCES:
            raise ValueError(
                f"accuracy.dtype must be one of {sorted(TOLERANCES)}, got {self.dtype!r}"
            )
        if self.top_k < 1:
            raise ValueError(f"accuracy.top_k must be >= 1, got {self.top_k}")
        if self.max_queue < 1:
            raise ValueError(f"accuracy.max_queue must be >= 1, got {self.max_queue}")
        _ = self.tolerance  # Tolerance checks the bounds

    @property
    def enabled(self) -> bool:
        return self.sample_rate > 0

    @property
    def tolerance(self) -> Tolerance:
        bounds = {"atol": self.atol, "rtol": self.rtol, "kl": self.kl, "topk": self.topk}
        given = {name: value for name, value in bounds.items() if value is not None}
        try:
            return replace(TOLERANCES[self.dtype], **given)
        except ValueError as err:
            raise ValueError(f"accuracy: {err}") from None


@dataclass(frozen=True)
class OnlineCheck:
    """One checked request: its prompt's last position, ours against the reference."""

    request_id: str
    num_prompt_tokens: int
    max_abs: float
    max_rel: float
    kl: float
    topk: float  # share of the reference's top-k tokens in ours
    top1_match: bool
    passed: bool


@dataclass(frozen=True)
class OnlineValidationStats:
    checks: int  # requests compared
    failures: int  # of those, past tolerance
    dropped: int  # sampled, not checked: queue full, reference unavailable, the check raised
    pending: int  # waiting for the worker


@dataclass
class _Item:
    request_id: str
    prompt_token_ids: list[int]
    logits: np.ndarray  # [vocab] float32: what the engine sampled the first token from


class OnlineValidator:
    """The sampling decision, the bounded queue and the worker thread (module docstring).

    ``on_check`` is called with each ``OnlineCheck`` on the worker thread, ``on_drop`` with
    each dropped check (on the engine loop; on the worker for a check that raised): both feed
    the replica's metrics.
    """

    def __init__(
        self,
        config: OnlineValidationConfig,
        on_check: Callable[[OnlineCheck], None] | None = None,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.tolerance = config.tolerance
        self.on_check = on_check
        self.on_drop = on_drop
        self._random = random.Random(config.seed)
        self._queue: queue.Queue[_Item | None] = queue.Queue(maxsize=config.max_queue)
        self._lock = threading.Lock()
        self._checks = self._failures = self._dropped = 0
        self._unavailable = False  # the reference did not load: every sample is dropped
        self._thread: threading.Thread | None = None

    def attach(self, engine: LLMEngine) -> OnlineValidator:
        """Loads the reference of ``engine``'s checkpoint, starts the worker and has
        ``engine`` sample its requests here.

        The reference is loaded and run once on the calling thread: transformers imports
        modules lazily (torch._dynamo among them), and the same imports from the worker while
        the engine loop imports its own can deadlock on the import locks.
        """
        model = engine.config.model
        reference = self._load_reference(model.path, model.architecture)
        if reference is not None:
            self._thread = threading.Thread(
                target=self._run, args=(reference,), name="online-validation", daemon=True
            )
            self._thread.start()
        engine.online_validation = self
        return self

    def wants(self) -> bool:
        """Whether the next request is sampled (``sample_rate``)."""
        return self._random.random() < self.config.sample_rate

    def submit(self, request_id: str, prompt_token_ids: list[int], logits: np.ndarray) -> bool:
        """Queues a check of ``logits`` [vocab] (the prompt's last position); False when it
        was dropped (queue full, reference unavailable). Never blocks."""
        if self._unavailable:
            self._drop()
            return False
        try:
            self._queue.put_nowait(_Item(request_id, list(prompt_token_ids), logits))
        except queue.Full:
            self._drop()
            return False
        return True

    def stats(self) -> OnlineValidationStats:
        with self._lock:
            return OnlineValidationStats(
                self._checks, self._failures, self._dropped, self._queue.unfinished_tasks
            )

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits until every queued check is done; False on timeout."""
        with self._queue.all_tasks_done:
            return self._queue.all_tasks_done.wait_for(
                lambda: not self._queue.unfinished_tasks, timeout_s
            )

    def close(self) -> None:
        """Stops the worker after the checks already queued."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _load_reference(self, path: Any, architecture: str) -> Any:
        """transformers' model of the checkpoint, after one forward; None if it fails (every
        sampled request is then dropped and counted: serving goes on)."""
        from neuron_runtime.accuracy.teacher import Reference

        try:
            reference = Reference(path, architecture, self.config.dtype)
            with torch.inference_mode():
                reference.model(input_ids=torch.zeros(1, 1, dtype=torch.long), logits_to_keep=1)
        except Exception:
            logger.exception("online validation is off: the reference of %s did not load", path)
            self._unavailable = True
            return None
        return reference

    def _drop(self) -> None:
        with self._lock:
            self._dropped += 1
        if self.on_drop is not None:
            self.on_drop()

    def _run(self, reference: Any) -> None:
        _lower_thread_priority()
        while (item := self._queue.get()) is not None:
            try:
                self._check(reference, item)
            except Exception:  # counted as dropped; the worker goes on with the next check
                logger.exception("online validation of request %s failed", item.request_id)
                self._drop()
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _check(self, reference: Any, item: _Item) -> None:
        ids = torch.tensor([item.prompt_token_ids])
        with torch.inference_mode():
            # Only the last position's logits: [1, vocab].
            expected = reference.model(input_ids=ids, logits_to_keep=1).logits[0, -1:].float()
        ours = torch.from_numpy(item.logits).unsqueeze(0)  # [1, vocab]
        (errors,) = compare_logits(ours, expected, self.tolerance, self.config.top_k)
        check = OnlineCheck(
            request_id=item.request_id,
            num_prompt_tokens=len(item.prompt_token_ids),
            max_abs=errors.max_abs,
            max_rel=errors.max_rel,
            kl=float(errors.kl or 0.0),
            topk=float(errors.topk or 0.0),
            top1_match=bool(errors.top1_match),
            passed=errors.passed,
        )
        with self._lock:
            self._checks += 1
            self._failures += not check.passed
        if not check.passed:
            t = self.tolerance
            logger.warning(
                "online validation: request %s is past tolerance at its prompt's last position "
                "(%d tokens): max abs logit error %.3g (allowed %g + %g x max|logit|), KL %.3g "
                "(allowed %g), top-%d share %.2f, top-1 %s",
                check.request_id,
                check.num_prompt_tokens,
                check.max_abs,
                t.atol,
                t.rtol,
                check.kl,
                t.kl,
                self.config.top_k,
                check.topk,
                "agrees" if check.top1_match else "differs",
            )
        if self.on_check is not None:
            self.on_check(check)


def _lower_thread_priority() -> None:
    """The calling thread at the lowest CPU priority (Linux keeps a nice value per thread):
    the checks take the cores the engine leaves idle, not the engine's share."""
    # Not Linux, or not allowed: the default priority.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
