"""``nn.Linear`` that runs on the CPU kernels' packed GEMM when the CPU backend attaches them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neuron_runtime.backends.cpu_kernels import CPUKernels


class Linear(nn.Linear):
    """Same parameters and checkpoint keys as ``nn.Linear``.

    ``attach(kernels)`` (the CPU backend, after the weights are loaded) repacks the weight into
    the kernels' panel layout and drops the ``[out, in]`` copy; from then on every product runs
    on ``kernels.linear``, which beats MKL's GEMM at every row count on the target CPUs.
    """

    kernels: CPUKernels | None = None
    packed: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("packed", None, persistent=False)

    def attach(self, kernels: CPUKernels) -> None:
        self.kernels = kernels
        self.packed = kernels.pack(self.weight)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is None or self.packed is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features).contiguous()
        y = self.kernels.linear(rows, self.packed, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)
