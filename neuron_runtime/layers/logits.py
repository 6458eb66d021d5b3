"""The vocabulary projection (lm_head), laid out for both decode and batched shapes.

On CPU the best layout depends on the number of rows. One row (batch-1 decode) is a GEMV:
reading the weight as ``[hidden, vocab]`` (contiguous along the vocab axis) runs about 1.5x
faster than ``F.linear`` on ``[vocab, hidden]``. Many rows are a GEMM whose output
(rows x 49k floats) spills the cache; computing it in slabs of vocab rows keeps each slab's
output hot and runs about 1.4x faster than one ``F.linear``. The head keeps both layouts
(one extra copy of the embedding matrix, made on first use) and picks per call.

With the CPU kernels (``kernels``, set by the CPU backend) every call runs on
``kernels.linear`` instead, faster at every row count, over a copy of the weight packed into
its panel layout on first use (``packed``, in place of the transposed copy).
"""

from __future__ import annotations

import torch
from torch import nn

from neuron_runtime.backends.cpu_kernels import CPUKernels

GEMV_MAX_ROWS = 4
VOCAB_SLAB = 1024


class LogitsHead(nn.Module):
    """Computes ``hidden @ weight.T`` for a ``[vocab, hidden]`` weight owned elsewhere."""

    kernels: CPUKernels | None = None

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight_t", torch.empty(0), persistent=False)
        self.register_buffer("packed", torch.empty(0), persistent=False)

    def refresh(self, weight: torch.Tensor) -> None:
        """Drops the derived copies; call after the weight is loaded or moved."""
        self.weight_t = torch.empty(0, device=weight.device)
        self.packed = torch.empty(0, device=weight.device)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        if self.kernels is not None:
            if self.packed.numel() == 0:
                self.packed = self.kernels.pack(weight)
            return self.kernels.linear(hidden.contiguous(), self.packed, None, weight.shape[0])
        if rows <= GEMV_MAX_ROWS:
            if self.weight_t.shape != weight.t().shape:
                self.weight_t = weight.detach().t().contiguous()
            return hidden @ self.weight_t
        vocab = weight.shape[0]
        out = hidden.new_empty(hidden.shape[0], vocab)
        for start in range(0, vocab, VOCAB_SLAB):
            end = min(start + VOCAB_SLAB, vocab)
            torch.mm(hidden, weight[start:end].t(), out=out[:, start:end])
        return out
