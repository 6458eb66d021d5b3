"""AsyncEngine: the engine loop on its own thread, driven from asyncio.

All engine state is touched by the loop thread only. Callers post commands (add, abort) to a
queue and receive outputs through per-request asyncio queues, so a server's event loop never
blocks on a forward pass (torch releases the GIL while it computes).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from neuron_runtime.engine import EngineStats, LLMEngine, PromptType
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.kv_transfer import KVHandoff
from neuron_runtime.multimodal import MultiModalInput
from neuron_runtime.outputs import RequestOutput, RequestOutputKind
from neuron_runtime.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served by this engine."""


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    kind: RequestOutputKind
    export_kv: bool = False
    handoff: KVHandoff | None = None
    mm_inputs: list[MultiModalInput] | None = None


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    """Serves concurrent ``generate`` calls from one engine, continuous batching them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = engine.stats()
        self._error: BaseException | None = None
        self._last_step = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncEngine:
        return cls(LLMEngine.from_engine_args(args))

    @property
    def tokenizer(self):  # noqa: ANN201
        return self.engine.tokenizer

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        kind: RequestOutputKind = RequestOutputKind.DELTA,
        *,
        export_kv: bool = False,
        handoff: KVHandoff | None = None,
        mm_inputs: list[MultiModalInput] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs as they come; the last one has ``finished=True``.

        Invalid input raises ValueError before anything is queued. Leaving the iterator early
        (client gone, task cancelled) aborts the request and frees its KV blocks.
        ``export_kv`` and ``handoff`` select the prefill and decode roles, ``mm_inputs`` are
        the prompt's images (``LLMEngine.add_request``).
        """
        self._check_alive()
        request_id = request_id or uuid.uuid4().hex
        sink: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        if request_id in self._sinks:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._sinks[request_id] = (loop, sink)
        self._commands.put(_Add(request_id, prompt, params, kind, export_kv, handoff, mm_inputs))
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine side has already forgotten it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def check_health(self, stall_timeout_s: float = 30.0) -> None:
        """Raises if the loop thread died, or has work but made no step for too long, or a
        tensor-parallel rank's process exited."""
        self._check_alive()
        check_ranks = getattr(self.engine.runner, "check_health", None)  # parallel/executor.py
        if check_ranks is not None:
            try:
                check_ranks()
            except RuntimeError as exc:
                raise EngineDeadError(str(exc)) from exc
        busy = self._stats.num_running + self._stats.num_waiting > 0
        if busy and time.monotonic() - self._last_step > stall_timeout_s:
            raise EngineDeadError(f"engine made no step in {stall_timeout_s:.0f}s with work queued")

    def shutdown(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=10)
        close_ranks = getattr(self.engine.runner, "close", None)  # parallel/executor.py
        if close_ranks is not None:
            close_ranks()

    def _check_alive(self) -> None:
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"engine loop is not running: {self._error!r}")

    # -- loop thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._drain(block):
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                self._stats = self.engine.stats()
                self._last_step = time.monotonic()
        except BaseException as exc:  # the loop is dead: tell every waiter
            self._error = exc
            for request_id in list(self._sinks):
                self._send(request_id, EngineDeadError(f"engine loop failed: {exc!r}"))
            raise

    def _drain(self, block: bool) -> bool:
        """Applies queued commands; waits for one if idle. False on shutdown."""
        while True:
            try:
                cmd = self._commands.get(block=block, timeout=None)
            except queue.Empty:
                return True
            if cmd is None:
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            else:
                output = self.engine.abort_request(cmd.request_id)
                if output is not None:
                    self._send(cmd.request_id, output)
            block = False

    def _add(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(
                cmd.request_id,
                cmd.prompt,
                cmd.params,
                cmd.kind,
                export_kv=cmd.export_kv,
                handoff=cmd.handoff,
                mm_inputs=cmd.mm_inputs,
            )
        except ValueError as exc:
            self._send(cmd.request_id, exc)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the engine
            for request_id in list(self.engine.output_processor.parents):
                self.engine.abort_request(request_id)
                self._send(request_id, RuntimeError(f"engine step failed: {exc!r}"))
            return
        # One hand-over per event loop for the whole step: each call_soon_threadsafe wakes
        # the loop (a write to its self-pipe) and takes the GIL from this thread.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            target = self._take_sink(output.request_id, output.finished)
            if target is not None:
                batches.setdefault(target[0], []).append((target[1], output))
        for loop, batch in batches.items():
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
                loop.call_soon_threadsafe(_put_all, batch)

    def _send(self, request_id: str, item: RequestOutput | BaseException) -> None:
        final = isinstance(item, BaseException) or item.finished
        target = self._take_sink(request_id, final)
        if target is None:
            return
        loop, sink = target
        # A RuntimeError means the caller's event loop is closed: nobody is listening.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(sink.put_nowait, item)

    def _take_sink(
        self, request_id: str, final: bool
    ) -> tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None:
        """The request's loop and queue; forgotten after its final item."""
        target = self._sinks.get(request_id)
        if target is not None and final:
            del self._sinks[request_id]
        return target


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for sink, item in batch:
        sink.put_nowait(item)
