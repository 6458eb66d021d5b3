"""CUDA backend: the same model code on a GPU, fp32 by default for exact comparisons."""

from __future__ import annotations

import torch


class CUDABackend:
    name = "cuda"

    def __init__(self, num_threads: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch sees no CUDA GPU")
        self.device = torch.device("cuda")
        self.kernels = None  # the fused kernels are CPU code
        if num_threads is not None:
            torch.set_num_threads(num_threads)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.float().to(self.device).eval()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
