"""``nn.Linear`` whose product runs on the backend's ops (``ops.linear``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from neuron_runtime.backends.ops import TORCH_OPS, Ops

if TYPE_CHECKING:
    from neuron_runtime.backends.cpu_kernels import QuantizedPanels


class Linear(nn.Linear):
    """Same parameters and checkpoint keys as ``nn.Linear``.

    A backend may keep the weight in a layout of its own: the CPU kernels repack it into
    ``packed`` panels at attach time and drop the ``[out, in]`` copy (backends/cpu_ops.py).
    """

    ops: Ops = TORCH_OPS
    packed: torch.Tensor | None
    # The weight's GGUF blocks when the CPU kernels run on them (backends/cpu_ops.py sets it
    # per layer). A class default, so the per-call lookup never takes nn.Module's slow path
    # for a missing attribute.
    quantized: QuantizedPanels | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("packed", None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(self, x)
