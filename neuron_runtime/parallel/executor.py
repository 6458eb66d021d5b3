"""One engine replica over a tensor-parallel group of processes on this host.

This process is rank 0: it keeps the engine (tokenizer, scheduler, KV block manager) and a
``ModelRunner`` over shard 0. Ranks 1..tp-1 are spawned processes that hold their shard and
run only the model: each waits for rank 0's broadcast of the next call, runs it on its own
runner and waits again. The calls that change a runner's state go to every rank in the same
order (a step's ``SchedulerOutput``, a finished request's release, a restored generator, a KV
import); reads (``num_blocks``, ``generator_state``) are answered by rank 0's runner. Every
rank samples the same tokens (the logits are gathered whole, generators seeded alike); rank 0's
are the ones the engine keeps.

Ranks 1..tp-1 start through a launcher named by ``distributed_executor_backend``: "mp",
``multiprocessing`` processes of this host; "ray", actors in the Serve replica's placement
group (registered by deployments/parallel_ranks.py, as this package imports no Ray). They join
rank 0 by gloo (CPU), nccl (CUDA) or xla (Neuron). A rank that dies breaks the group:
``check_health`` reports it, and rank 0's next collective fails instead of waiting.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any, Protocol, cast

import numpy as np
import torch

from neuron_runtime.backends import Backend, get_backend
from neuron_runtime.config import EngineConfig
from neuron_runtime.kv_transfer import KVPayload
from neuron_runtime.model_runner import ModelRunner, ModelRunnerOutput
from neuron_runtime.parallel.collectives import destroy_world, init_world
from neuron_runtime.parallel.state import (
    ParallelState,
    build_parallel_state,
    use_parallel_state,
)
from neuron_runtime.scheduler import SchedulerOutput

# How long a collective waits for a rank before failing (the model load included).
COLLECTIVE_TIMEOUT_S = 600.0

# The device's collective backend when the config names none.
DEVICE_COLLECTIVES = {"cpu": "gloo", "cuda": "nccl", "xla": "xla", "neuron": "xla"}


def collective_backend(config: EngineConfig) -> str:
    return config.parallel.collective_backend or DEVICE_COLLECTIVES[config.device]


class RankHandle(Protocol):
    """A started rank other than 0: a process or an actor."""

    def is_alive(self) -> bool: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


# (config, rank, init_method) -> the started rank, running ``run_worker``
RankLauncher = Callable[[EngineConfig, int, str], RankHandle]


def spawn_rank(config: EngineConfig, rank: int, init_method: str) -> RankHandle:
    """Rank ``rank`` as a spawned process of this host."""
    proc = mp.get_context("spawn").Process(
        target=run_worker,
        args=(config, rank, init_method),
        name=f"neuron-tp-rank{rank}",
        daemon=True,
    )
    proc.start()
    return proc


_LAUNCHERS: dict[str, RankLauncher] = {"mp": spawn_rank}


def register_rank_launcher(name: str, launcher: RankLauncher) -> None:
    _LAUNCHERS[name] = launcher


class Call(IntEnum):
    EXECUTE = 1
    RELEASE = 2
    RESTORE_GENERATOR = 3
    IMPORT_KV = 4
    EXPORT_KV = 5
    STOP = 6


@dataclass(frozen=True)
class RunnerCall:
    """What rank 0 broadcasts: one runner call and its arguments (plain data)."""

    call: Call
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class FilledRow:
    """A grammar bitmask row already filled ([ceil(V / 32)] int32), as plain data: what a
    ``BitmaskRow`` (whose fill may still run on rank 0's thread) becomes for the other ranks."""

    row: torch.Tensor

    def get(self) -> torch.Tensor:
        return self.row


def portable(out: SchedulerOutput) -> SchedulerOutput:
    """The step with every grammar bitmask row filled, so it pickles for the other ranks."""
    if all(seq.grammar_bitmask is None for seq in out.seqs):
        return out
    seqs = [
        seq
        if seq.grammar_bitmask is None
        else replace(seq, grammar_bitmask=cast(Any, FilledRow(seq.grammar_bitmask.get().clone())))
        for seq in out.seqs
    ]
    return replace(out, seqs=seqs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join_group(config: EngineConfig, rank: int, init_method: str) -> ParallelState:
    backend = collective_backend(config)
    init_world(
        backend, rank, config.parallel.tensor_parallel_size, init_method, COLLECTIVE_TIMEOUT_S
    )
    return build_parallel_state(config.parallel, rank, backend)


def _export_local(runner: ModelRunner, block_table: list[int], num_tokens: int) -> tuple:
    return runner.kv_heads.start, runner.export_kv(block_table, num_tokens)


def run_worker(config: EngineConfig, rank: int, init_method: str) -> None:
    """A rank other than 0: load this rank's shard, then run rank 0's calls until STOP."""
    state = _join_group(config, rank, init_method)
    with use_parallel_state(state):
        runner = ModelRunner(
            config, get_backend(config.device, config.num_threads, dtype=config.model.dtype)
        )
    tp = state.tp
    while True:
        msg: RunnerCall = tp.broadcast_object(None, src=0)
        if msg.call == Call.STOP:
            break
        if msg.call == Call.EXECUTE:
            runner.execute(*msg.args)
        elif msg.call == Call.RELEASE:
            runner.release(*msg.args)
        elif msg.call == Call.RESTORE_GENERATOR:
            runner.restore_generator(*msg.args)
        elif msg.call == Call.IMPORT_KV:
            runner.import_kv(*msg.args)
        elif msg.call == Call.EXPORT_KV:
            tp.gather_object(_export_local(runner, *msg.args), dst=0)
    tp.barrier()
    destroy_world()


class MultiprocExecutor:
    """Rank 0's side of a tensor-parallel replica: the engine's ``runner``.

    Has the ``ModelRunner`` methods the engine calls; everything else is rank 0's runner's.
    """

    def __init__(self, config: EngineConfig, backend: Backend) -> None:
        self.config = config
        tp = config.parallel.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        name = config.parallel.distributed_executor_backend
        if name not in _LAUNCHERS:
            raise ValueError(f"distributed_executor_backend {name!r} is not available here")
        # One call at a time, each sent and run whole: the engine's loop and a KV read on
        # another thread (read_kv) must reach every rank in the same order.
        self.lock = threading.Lock()
        self.workers: list[RankHandle] = []
        try:
            for rank in range(1, tp):
                self.workers.append(_LAUNCHERS[name](config, rank, init_method))
            self.state = _join_group(config, 0, init_method)
            with use_parallel_state(self.state):
                self.runner = ModelRunner(config, backend)
        except BaseException:
            self._kill_workers()
            raise
        self.closed = False
        atexit.register(self.close)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not set in __init__: rank 0's runner's attributes.
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)

    def _send(self, call: Call, *args: Any) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel group is closed")
        self.state.tp.broadcast_object(RunnerCall(call, args), src=0)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        with self.lock:
            self._send(Call.EXECUTE, portable(out))
            return self.runner.execute(out)

    def release(self, req_id: str) -> None:
        with self.lock:
            self._send(Call.RELEASE, req_id)
            self.runner.release(req_id)

    def restore_generator(self, req_id: str, seed: int, state: np.ndarray) -> None:
        with self.lock:
            self._send(Call.RESTORE_GENERATOR, req_id, seed, state)
            self.runner.restore_generator(req_id, seed, state)

    def import_kv(self, block_table: list[int], payload: KVPayload) -> None:
        with self.lock:
            self._send(Call.IMPORT_KV, block_table, payload)
            self.runner.import_kv(block_table, payload)

    def export_kv(self, block_table: list[int], num_tokens: int) -> np.ndarray:
        """The sequence's KV over every kv head of the model, each rank's heads put in place:
        [2, num_layers, num_kv_heads, num_tokens, head_dim] as a TP=1 engine exports it."""
        with self.lock:
            self._send(Call.EXPORT_KV, block_table, num_tokens)
            parts = self.state.tp.gather_object(_export_local(self.runner, block_table, num_tokens))
        assert parts is not None
        m = self.config.model
        kv = np.empty((2, m.num_layers, m.num_kv_heads, num_tokens, m.head_dim), np.float32)
        for start, part in parts:
            kv[:, :, start : start + part.shape[2]] = part
        return kv

    def check_health(self) -> None:
        """Raises RuntimeError naming the ranks whose process has exited."""
        dead = [i + 1 for i, proc in enumerate(self.workers) if not proc.is_alive()]
        if dead and not self.closed:
            raise RuntimeError(f"tensor-parallel rank(s) {dead} exited")

    def close(self) -> None:
        """Stops the other ranks and leaves the group (idempotent)."""
        if self.closed:
            return
        atexit.unregister(self.close)
        try:
            self.check_health()
            with self.lock:
                self._send(Call.STOP)
                self.state.tp.barrier()
            for proc in self.workers:
                proc.join(timeout=30)
        except RuntimeError:
            pass  # a rank is gone: the group cannot stop cleanly
        finally:
            self.closed = True
            self._kill_workers()
            destroy_world()

    def _kill_workers(self) -> None:
        for proc in self.workers:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)


def make_runner(config: EngineConfig, backend: Backend) -> ModelRunner:
    """The engine's runner: this process's ModelRunner, or rank 0 of a tensor-parallel group
    (a ``MultiprocExecutor``, which answers every ModelRunner method the engine calls)."""
    if config.parallel.tensor_parallel_size == 1:
        return ModelRunner(config, backend)
    return cast(ModelRunner, MultiprocExecutor(config, backend))
