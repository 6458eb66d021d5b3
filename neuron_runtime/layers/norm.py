"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch

from neuron_runtime.backends.cpu_kernels import CPUKernels


class RMSNorm(torch.nn.Module):
    # Set by the CPU backend (backends/cpu.py); None keeps the torch ops.
    kernels: CPUKernels | None = None

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
        (norm(x), x). The fused kernel adds into ``x`` in place: callers pass a layer's own
        output, never a tensor they keep."""
        if self.kernels is not None and x.is_contiguous():
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps), x
        residual = x if residual is None else x + residual
        return self(residual), residual
