"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch

from neuron_runtime.backends.ops import TORCH_OPS, Ops


class RMSNorm(torch.nn.Module):
    ops: Ops = TORCH_OPS

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); the first layer has no residual yet:
        (norm(x), x). A backend may add into ``x`` in place: callers pass a layer's own
        output, never a tensor they keep."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
