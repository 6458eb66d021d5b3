"""CPU backend: fp32 (no native bf16 on the target CPUs), a fixed torch thread count."""

from __future__ import annotations

import torch
from torch import nn

from neuron_runtime.backends.cpu_kernels import CPUKernels, kernels
from neuron_runtime.layers.linear import Linear


def to_input_major(model: nn.Module) -> None:
    """Stores every Linear weight as ``[in, out]`` in memory, same logical ``[out, in]`` shape.

    ``F.linear`` then multiplies by a contiguous ``[in, out]`` matrix. For one row (decode at
    batch 1, a GEMV that streams every weight once) MKL runs this layout about 20% faster on
    the target CPUs; for batched rows the two layouts are on par. Only without the CPU
    kernels, which pack the weights into a layout of their own.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight.data = module.weight.data.t().contiguous().t()


def attach_kernels(model: nn.Module, fused: CPUKernels) -> None:
    """Hands the fused kernels to every module that has a place for them (``kernels``);
    ``Linear`` layers also repack their weights for them."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.attach(fused)
        elif "kernels" in dir(type(module)):
            setattr(module, "kernels", fused)  # noqa: B010 (a plain attribute, not a Module)


class CPUBackend:
    name = "cpu"

    def __init__(self, num_threads: int | None = None) -> None:
        self.device = torch.device("cpu")
        self.kernels = kernels()  # None: torch ops only (no compiler, or turned off)
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        model = model.float().eval()
        if self.kernels is None:
            to_input_major(model)
        else:  # the kernels pack the weights into their own layout
            attach_kernels(model, self.kernels)
        return model

    def synchronize(self) -> None:
        pass
