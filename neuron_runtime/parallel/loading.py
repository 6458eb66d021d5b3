"""Which part of each checkpoint tensor this rank reads, and the settling after loading.

A sharded layer knows the part of its parameters' checkpoint tensors it holds
(``checkpoint_slice``); the model maps checkpoint names to its parameters
(``checkpoint_target``). Together they let ``loader.iter_weights`` read only this rank's
rows or columns from the safetensors file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

from torch import nn

from neuron_runtime.parallel.layers import ShardedLinear, Slice
from neuron_runtime.parallel.state import parallel_state

# A checkpoint tensor this rank needs none of (an expert another rank holds).
SKIP: Slice = (0, 0, 0)


class Sliced(Protocol):
    def checkpoint_slice(self, param: str, shard: int | None) -> Slice | None: ...


def checkpoint_slicer(model: nn.Module) -> Callable[[str], Slice | None] | None:
    """``name -> part this rank reads`` for a model built under a TP or EP group of several
    ranks; None (read everything) otherwise."""
    target_of = getattr(model, "checkpoint_target", None)
    state = parallel_state()
    if (state.tp.size == 1 and state.ep.size == 1) or target_of is None:
        return None

    def rank_slice(name: str) -> Slice | None:
        target, shard = target_of(name)
        module_name, _, param = target.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            return None  # the model's load_weights reports a name with no place
        if hasattr(module, "checkpoint_slice"):
            return cast(Sliced, module).checkpoint_slice(param, shard)
        return None

    return rank_slice


def finish_loading(model: nn.Module) -> None:
    """Lets every sharded layer settle its weights once the checkpoint is in."""
    for module in model.modules():
        if isinstance(module, ShardedLinear):
            module.finish_loading()
