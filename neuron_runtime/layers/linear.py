"""``nn.Linear`` whose few-row products (decode steps) can run on the CPU kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neuron_runtime.backends.cpu_kernels import CPUKernels


class Linear(nn.Linear):
    """Same parameters and checkpoint keys as ``nn.Linear``.

    With ``kernels`` set (by the CPU backend), inputs of up to ``kernels.LINEAR_MAX_ROWS`` rows
    go through ``kernels.linear``, which streams the weight once; bigger ones stay on MKL.
    """

    kernels: CPUKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self.kernels
        if (
            kernels is not None
            and x.dim() == 2
            and x.shape[0] <= kernels.LINEAR_MAX_ROWS
            and x.is_contiguous()
        ):
            return kernels.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
