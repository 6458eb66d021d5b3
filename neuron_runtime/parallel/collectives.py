"""Collectives behind one interface: all-reduce, all-gather, reduce-scatter, all-to-all,
broadcast.

``Communicator`` is a group of ranks. Two implementations:
- ``Communicator`` (the base): a group of one (TP=1), every collective the identity.
- ``TorchCommunicator``: a ``torch.distributed`` group on the backend of the device: ``gloo``
  (CPU tensors), ``nccl`` (CUDA) or ``xla`` (XLA/Neuron devices; torch-xla registers the
  backend, imported here only when it is asked for). Python objects (a step's inputs) go
  through a gloo group beside it, for nccl and xla move only device tensors.

Sizes along the gathered dimension may differ between ranks (a vocabulary or a head count
that the group size does not divide): ``all_gather`` pads to the largest part and trims.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist


class Communicator:
    """The collectives of one group; this base class is the group of one rank."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over the group, in place when the backend can."""
        return x

    def all_gather(self, x: torch.Tensor, dim: int, sizes: list[int] | None = None) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``; ``sizes`` (per rank, along ``dim``)
        when they differ."""
        return x

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The sum over the group, of which this rank keeps its equal part along ``dim``."""
        return x

    def all_to_all(
        self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        """Rows of ``x`` [sum(send_counts), ...] go ``send_counts[r]`` to rank r, in rank
        order; returns the rows received [sum(recv_counts), ...], in rank order."""
        return x

    def all_to_all_counts(self, send_counts: list[int]) -> list[int]:
        """What each rank will send this one, given what this one sends each rank."""
        return send_counts

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return x

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` (pickled), on every rank."""
        return obj

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on ``dst``; None elsewhere."""
        return [obj]

    def barrier(self) -> None:
        pass


class TorchCommunicator(Communicator):
    """A ``torch.distributed`` group (``ranks`` of the world) on ``backend``; made by
    ``new_communicator``."""

    def __init__(self, ranks: list[int], group: Any, cpu_group: Any) -> None:
        self.ranks = ranks
        self.size = len(ranks)
        self.rank = ranks.index(dist.get_rank())
        self.group = group
        self.cpu_group = cpu_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int, sizes: list[int] | None = None) -> torch.Tensor:
        dim = dim % x.dim()
        width = max(sizes) if sizes else x.shape[dim]
        if x.shape[dim] < width:
            pad = list(x.shape)
            pad[dim] = width - x.shape[dim]
            x = torch.cat((x, x.new_zeros(pad)), dim=dim)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        if sizes:
            parts = [p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)]
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        moved = x.movedim(dim, 0).contiguous()  # [N, ...]: the rank's part is rows
        out = moved.new_empty(moved.shape[0] // self.size, *moved.shape[1:])
        dist.reduce_scatter_tensor(out, moved, group=self.group)
        return out.movedim(0, dim)

    def all_to_all(
        self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        out = x.new_empty(sum(recv_counts), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.group)
        return out

    def all_to_all_counts(self, send_counts: list[int]) -> list[int]:
        send = torch.tensor(send_counts, dtype=torch.long)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.cpu_group)
        return [int(n) for n in recv.tolist()]

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(x, self.ranks[src], group=self.group)
        return x

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, self.ranks[src], group=self.cpu_group)
        return box[0]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        out: list[Any] | None = [None] * self.size if self.rank == dst else None
        dist.gather_object(obj, out, dst=self.ranks[dst], group=self.cpu_group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.cpu_group)


def new_communicator(ranks: list[int], backend: str) -> TorchCommunicator | None:
    """The group of ``ranks``; None on the other ranks. Creating a group is collective: every
    rank of the world calls this for every group, in the same order."""
    group = dist.new_group(ranks, backend=backend)
    # Objects travel on CPU tensors: a gloo group beside a device group.
    cpu_group = group if backend == "gloo" else dist.new_group(ranks, backend="gloo")
    if dist.get_rank() not in ranks:
        return None
    return TorchCommunicator(ranks, group, cpu_group)


def init_world(
    backend: str, rank: int, world_size: int, init_method: str, timeout_s: float
) -> None:
    """Joins this process to the world's process group (``backend`` gloo, nccl or xla)."""
    if backend == "xla":
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def destroy_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
