"""The vocabulary projection (lm_head), on the backend's ops (``ops.logits``).

The head may keep derived copies of the weight it does not own, made on first use: the torch
ops on CPU a ``[hidden, vocab]`` copy for GEMVs (``weight_t``), the CPU kernels a panel-packed
copy (``packed``). ``refresh`` drops them after the weight is loaded or moved.
"""

from __future__ import annotations

import torch
from torch import nn

from neuron_runtime.backends.ops import TORCH_OPS, Ops


class LogitsHead(nn.Module):
    """Computes ``hidden @ weight.T`` for a ``[vocab, hidden]`` weight owned elsewhere."""

    ops: Ops = TORCH_OPS
    weight_t: torch.Tensor
    packed: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight_t", torch.empty(0), persistent=False)
        self.register_buffer("packed", torch.empty(0), persistent=False)

    def refresh(self, weight: torch.Tensor) -> None:
        """Drops the derived copies; call after the weight is loaded or moved."""
        self.weight_t = torch.empty(0, device=weight.device)
        self.packed = torch.empty(0, device=weight.device)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.ops.logits(self, hidden, weight)
