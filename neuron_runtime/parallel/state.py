"""Parallel state: which ranks form the tensor-, expert- and data-parallel groups.

Ranks are laid out data-parallel major: rank = dp_rank * tp + tp_rank, so the ranks of one
replica are neighbours (on Trainium, neighbouring NeuronCores). A TP group is one replica's
ranks; a DP group is the ranks with the same tp_rank in every replica. With
``enable_expert_parallel`` the EP group is every rank (DP * TP): the experts are spread over
all of them, each replica's tokens travel to their experts' ranks and back (layers/moe.py);
with one replica that is its TP group.

Layers read the groups in effect when they are built (``tp_group()``) and keep them, as the
model classes take only the HF config. The groups are in effect only while a rank builds its
model (``use_parallel_state``); otherwise they are groups of one, so a TP=1 engine beside a
TP=2 one in the same process builds an unsharded model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from neuron_runtime.config import ParallelConfig
from neuron_runtime.parallel.collectives import Communicator, new_communicator


@dataclass(frozen=True)
class RankLayout:
    """The groups of every rank of ``data_parallel_size`` replicas of ``tensor_parallel_size``."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    @classmethod
    def of(cls, config: ParallelConfig) -> RankLayout:
        return cls(config.tensor_parallel_size, config.data_parallel_size)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def dp_rank(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tp_groups(self) -> list[list[int]]:
        tp = self.tensor_parallel_size
        return [list(range(d * tp, (d + 1) * tp)) for d in range(self.data_parallel_size)]

    def dp_groups(self) -> list[list[int]]:
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        return [[d * tp + t for d in range(dp)] for t in range(tp)]


@dataclass
class ParallelState:
    """This process's rank and its groups (all of one rank outside a parallel engine)."""

    rank: int = 0
    world_size: int = 1
    tp: Communicator = field(default_factory=Communicator)
    dp: Communicator = field(default_factory=Communicator)
    expert_parallel: bool = False
    # Every rank of every replica, when experts spread over more than one replica.
    world: Communicator | None = None

    @property
    def ep(self) -> Communicator:
        """The group the experts are spread over under expert parallelism: every rank (the
        TP group with one replica); a group of one otherwise."""
        if not self.expert_parallel:
            return Communicator()
        return self.world or self.tp


_STATE = ParallelState()


def parallel_state() -> ParallelState:
    return _STATE


def tp_group() -> Communicator:
    """The tensor-parallel group of this process (a group of one outside a parallel engine)."""
    return _STATE.tp


def build_parallel_state(config: ParallelConfig, rank: int, backend: str) -> ParallelState:
    """This rank's groups over the already joined world (``collectives.init_world``).

    Every rank must call this, in the same order: creating a group is itself collective.
    """
    layout = RankLayout.of(config)
    tp: Communicator | None = None
    dp: Communicator | None = None
    for ranks in layout.tp_groups():
        tp = new_communicator(ranks, backend) or tp
    for ranks in layout.dp_groups():
        if len(ranks) > 1:
            dp = new_communicator(ranks, backend) or dp
    assert tp is not None
    world = None
    if config.enable_expert_parallel and layout.data_parallel_size > 1:
        world = new_communicator(list(range(layout.world_size)), backend)
    return ParallelState(
        rank=rank,
        world_size=layout.world_size,
        tp=tp,
        dp=dp or Communicator(),
        expert_parallel=config.enable_expert_parallel,
        world=world,
    )


@contextmanager
def use_parallel_state(state: ParallelState) -> Iterator[ParallelState]:
    """Puts ``state``'s groups in effect for the models and layers built inside."""
    global _STATE
    saved, _STATE = _STATE, state
    try:
        yield state
    finally:
        _STATE = saved
