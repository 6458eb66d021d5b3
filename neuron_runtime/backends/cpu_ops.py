"""The CPU backend's ops on the fused C kernels (backends/cpu_kernels.c).

Linear layers and the logits head run on the packed-panel GEMM over weights repacked once at
``attach``; add+RMSNorm, SiLU-and-mul, rotary and the KV write are fused; decodes attend in
one kernel call over padded block tables. Prefill slices keep the torch path (SDPA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from neuron_runtime.backends.cpu_kernels import CPUKernels
from neuron_runtime.backends.ops import Ops
from neuron_runtime.layers.attention import (
    AttentionMetadata,
    DecodeRows,
    PrefillSlice,
    StepMetadata,
    attend_prefills,
    pad_tables,
)

if TYPE_CHECKING:
    from neuron_runtime.layers.linear import Linear
    from neuron_runtime.layers.logits import LogitsHead


@dataclass
class KernelAttentionMetadata(AttentionMetadata):
    """The decodes as one kernel call: block tables padded to the longest context."""

    decode_tables: torch.Tensor | None = None  # [num_decode, max_blocks] long, zero-padded
    decode_lens: torch.Tensor | None = None  # [num_decode] long, the new token included


class CPUKernelOps(Ops):
    """``Ops`` on the fused CPU kernels; inputs the kernels cannot take fall back to torch."""

    name = "cpu_kernels"
    decode_rows_any_order = True  # paged_decode_attention: one block table and length per row

    def __init__(self, kernels: CPUKernels) -> None:
        self.kernels = kernels

    def attach(self, model: nn.Module) -> None:
        """Also repacks every ``Linear`` weight into the kernels' panel layout, dropping the
        ``[out, in]`` copy."""
        from neuron_runtime.layers.linear import Linear

        super().attach(model)
        for module in model.modules():
            if isinstance(module, Linear):
                module.packed = self.kernels.pack(module.weight)
                module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)

    def linear(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.packed is None:  # not attached (built after the backend prepared the model)
            return F.linear(x, layer.weight, layer.bias)
        rows = x.reshape(-1, layer.in_features).contiguous()
        y = self.kernels.linear(rows, layer.packed, layer.bias, layer.out_features)
        return y.view(*x.shape[:-1], layer.out_features)

    def logits(self, head: LogitsHead, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if head.packed.numel() == 0:
            head.packed = self.kernels.pack(weight)
        return self.kernels.linear(hidden.contiguous(), head.packed, None, weight.shape[0])

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
            return super().add_rms_norm(x, residual, weight, eps)
        return self.kernels.add_rms_norm(x, residual, weight, eps), x

    def act_and_mul(
        self, gate_up: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        if act_fn is not F.silu or not gate_up.is_contiguous():
            return super().act_and_mul(gate_up, act_fn)
        return self.kernels.silu_and_mul(gate_up)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rows, heads, d = x.shape
        if x.stride(2) != 1 or x.stride(1) != d:
            return super().rotary(x, cos, sin)
        return self.kernels.rotary_(x, cos.view(rows, -1), sin.view(rows, -1), heads)

    def attention_metadata(
        self,
        slot_mapping: list[int],
        decodes: DecodeRows,
        prefills: list[PrefillSlice],
        block_size: int,
        device: torch.device,
    ) -> StepMetadata:
        lens = decodes.context_lens
        width = max((-(-n // block_size) for n in lens), default=0)
        return KernelAttentionMetadata(
            torch.tensor(slot_mapping, dtype=torch.long),
            len(lens),
            prefills,
            decode_tables=torch.tensor(pad_tables(decodes.block_tables, width), dtype=torch.long),
            decode_lens=torch.tensor(lens, dtype=torch.long),
        )

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: StepMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        assert isinstance(meta, KernelAttentionMetadata)
        self.kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)
        if meta.num_decode:
            assert meta.decode_tables is not None and meta.decode_lens is not None
            out[: meta.num_decode] = self.kernels.decode_attention(
                q[: meta.num_decode],
                k_cache,
                v_cache,
                meta.decode_tables,
                meta.decode_lens,
                scale,
                sliding_window,
                softcap,
            )
        window = sliding_window
        attend_prefills(out, q, k, v, k_cache, v_cache, meta.prefills, scale, window, softcap)
        return out.view(q.shape[0], -1)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if not logits.is_contiguous() or logits.dtype != torch.float32:
            return super().argmax(logits)
        return self.kernels.argmax(logits)
