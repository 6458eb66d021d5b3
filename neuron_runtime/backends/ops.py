"""The ops a backend supplies to the model code: one small set, the same for every backend.

Model code (layers/, models/) never asks which backend it runs on; it calls ``self.ops.<op>``
and the backend decides how the op runs. ``Ops.attach`` hands one instance to every module of
a loaded model that declares an ``ops`` attribute (a module built outside an engine, e.g. in a
test, keeps the class default, ``TORCH_OPS``).

Implementations:
- ``Ops`` (this file): eager torch ops with dynamic shapes, on any device. Decode attention
  runs in groups of similar context length (layers/attention.py).
- ``CPUKernelOps`` (backends/cpu_ops.py): the fused C kernels of backends/cpu_kernels.c.
- ``StaticOps`` (backends/static/ops.py): torch ops in fixed shapes with no host round-trip,
  for graphs compiled per bucket (inductor, XLA, Neuron).

Every op returns the same values as ``Ops``, up to floating-point summation order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from neuron_runtime.layers.attention import (
    AttentionMetadata,
    DecodeRows,
    PrefillSlice,
    StepMetadata,
    decode_groups,
    paged_attention,
)
from neuron_runtime.layers.rotary import apply_rotary

if TYPE_CHECKING:
    from neuron_runtime.layers.linear import Linear
    from neuron_runtime.layers.logits import LogitsHead

# The logits head on CPU: one row (a GEMV) reads the weight faster as [hidden, vocab]; many
# rows (a GEMM whose output spills the cache) run faster in slabs of vocab rows.
GEMV_MAX_ROWS = 4
VOCAB_SLAB = 1024


class FusedDecode(Protocol):
    """A model's decode step as one call (``Ops.decode_step``)."""

    def __call__(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        context_lens: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode rows, one per sequence: the final hidden states [rows, hidden] and the
        logits [rows, vocab]."""
        ...

    def current(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether the weights and caches it was built on are still the model's."""
        ...


class Ops:
    """Eager torch ops: the reference implementation of the backend op set."""

    name = "torch"
    # Whether decode attention takes its rows in any order of context length (each row its
    # own block table and length); then speculative slices attend as decode rows.
    decode_rows_any_order = False

    def attach(self, model: nn.Module) -> None:
        """Hands these ops to every module of ``model`` that has a place for them."""
        for module in model.modules():
            if "ops" in dir(type(module)):
                setattr(module, "ops", self)  # noqa: B010 (a plain attribute, not a Module)

    def decode_step(
        self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> FusedDecode | None:
        """A whole decode step of ``model`` as one call, where the backend has one for it
        (``CPUKernelOps``: backends/cpu_decode.py); None: the model's modules run it."""
        return None

    # Dense layers -----------------------------------------------------------------------
    def linear(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x @ layer.weight.T + layer.bias`` for ``x`` [..., in] -> [..., out]."""
        return F.linear(x, layer.weight, layer.bias)

    def logits(self, head: LogitsHead, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``hidden`` [rows, H] times a ``[vocab, H]`` weight: [rows, vocab]."""
        rows = hidden.shape[0]
        if rows <= GEMV_MAX_ROWS and hidden.device.type == "cpu":
            if head.weight_t.shape != weight.t().shape:
                head.weight_t = weight.detach().t().contiguous()
            return hidden @ head.weight_t
        if hidden.device.type != "cpu":
            return hidden @ weight.t()
        vocab = weight.shape[0]
        out = hidden.new_empty(rows, vocab)
        for start in range(0, vocab, VOCAB_SLAB):
            end = min(start + VOCAB_SLAB, vocab)
            torch.mm(hidden, weight[start:end].t(), out=out[:, start:end])
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual) * weight, x + residual); without a residual, (norm(x), x).

        May add into ``x`` in place: callers pass a layer's own output, never a tensor they
        keep."""
        summed = x if residual is None else x + residual
        return torch.rms_norm(summed, (summed.shape[-1],), weight, eps), summed

    def act_and_mul(
        self, gate_up: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``act(gate) * up`` of ``[T, 2 * I]`` holding gate then up: [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return act_fn(gate) * up

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates ``x`` [T, heads, d] (half-split pairs) by ``cos``/``sin`` [T, 1, d/2]; may
        work in place (``x`` is a layer's own projection)."""
        return apply_rotary(x, cos, sin)

    # Attention over the paged cache ---------------------------------------------------------
    def attention_metadata(
        self,
        slot_mapping: list[int],
        decodes: DecodeRows,
        prefills: list[PrefillSlice],
        block_size: int,
        device: torch.device,
    ) -> StepMetadata:
        """What every layer's attention needs for one step, built once by the runner."""
        groups = decode_groups(decodes.block_tables, decodes.context_lens, block_size, device)
        return AttentionMetadata(
            torch.tensor(slot_mapping, device=device),
            len(decodes.context_lens),
            prefills,
            decode_groups=groups,
        )

    def attention(
        self,
        q: torch.Tensor,  # [T, qh, d]
        k: torch.Tensor,  # [T, kvh, d]
        v: torch.Tensor,  # [T, kvh, d]
        k_cache: torch.Tensor,  # [kvh, num_blocks, block_size, d]
        v_cache: torch.Tensor,
        meta: StepMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """Writes this step's K/V into the cache and attends: [T, qh * d]."""
        assert isinstance(meta, AttentionMetadata)
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window, softcap)

    # Sampling -------------------------------------------------------------------------------
    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Row argmax of ``[rows, vocab]`` (the first maximum): [rows] long."""
        return logits.argmax(dim=-1)


TORCH_OPS = Ops()
