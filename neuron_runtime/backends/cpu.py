"""CPU backend: fp32 (bf16 linear layers as an option where the CPU has AVX512_BF16), a fixed
torch thread count.

Eager steps run on the fused C kernels (``CPUKernelOps``) when they build, else on torch ops.
"""

from __future__ import annotations

import torch
from torch import nn

from neuron_runtime.backends.cpu_kernels import default_num_threads, kernels
from neuron_runtime.backends.cpu_ops import CPUKernelOps
from neuron_runtime.backends.ops import TORCH_OPS, Ops
from neuron_runtime.backends.static.ops import STATIC_OPS
from neuron_runtime.config import DTYPES


def to_input_major(model: nn.Module) -> None:
    """Stores every Linear weight as ``[in, out]`` in memory, same logical ``[out, in]`` shape.

    ``F.linear`` then multiplies by a contiguous ``[in, out]`` matrix. For one row (decode at
    batch 1, a GEMV that streams every weight once) MKL runs this layout about 20% faster on
    the target CPUs; for batched rows the two layouts are on par. Only for the torch ops: the
    kernels pack the weights into a layout of their own.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight.data = module.weight.data.t().contiguous().t()


class CPUBackend:
    name = "cpu"
    graph_modes = ("eager", "inductor")
    dtypes = DTYPES  # "bfloat16": on the kernels, where the CPU has AVX512_BF16

    def __init__(
        self, num_threads: int | None = None, graph_mode: str = "eager", dtype: str = "float32"
    ) -> None:
        self.device = torch.device("cpu")
        if num_threads is None:
            num_threads = default_num_threads()
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        fused = kernels()  # None: no compiler, or turned off
        if dtype != "float32" and graph_mode != "eager":  # compiled graphs run fp32 ops
            raise ValueError(f"dtype {dtype!r} runs in graph_mode 'eager' only")
        if dtype == "bfloat16" and (fused is None or not fused.has_bf16):
            raise ValueError(
                "dtype 'bfloat16' runs on the CPU kernels of a CPU with AVX512_BF16; "
                + ("the kernels are off here" if fused is None else "this CPU has none")
                + ": use dtype 'float32'"
            )
        self.ops: Ops = TORCH_OPS if fused is None else CPUKernelOps(fused, dtype)
        if graph_mode != "eager":  # compiled graphs: the kernels' ctypes calls cannot trace
            self.ops = STATIC_OPS
        # On the kernels their pool does the parallel work and torch's keeps one thread: its
        # idle workers spin after every parallel op, taking the cores from the kernels'.
        if fused is not None and isinstance(self.ops, CPUKernelOps):
            fused.set_num_threads(num_threads)
            torch.set_num_threads(1)
        else:
            torch.set_num_threads(num_threads)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        model = model.float().eval()
        if self.ops is TORCH_OPS:
            to_input_major(model)
        self.ops.attach(model)
        return model

    def synchronize(self) -> None:
        pass
