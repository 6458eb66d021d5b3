"""CUDA backend: the same model code on a GPU, fp32 by default for exact comparisons."""

from __future__ import annotations

import torch

from neuron_runtime.backends.ops import TORCH_OPS, Ops
from neuron_runtime.backends.static.ops import STATIC_OPS


class CUDABackend:
    name = "cuda"
    graph_modes = ("eager", "inductor")

    def __init__(self, num_threads: int | None = None, graph_mode: str = "eager") -> None:
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch sees no CUDA GPU")
        self.device = torch.device("cuda")
        self.ops: Ops = TORCH_OPS if graph_mode == "eager" else STATIC_OPS
        if num_threads is not None:
            torch.set_num_threads(num_threads)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.float().to(self.device).eval()
        self.ops.attach(model)
        return model

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
