"""CPU backend: fp32 (no native bf16 on the target CPUs), a fixed torch thread count."""

from __future__ import annotations

import torch


class CPUBackend:
    name = "cpu"

    def __init__(self, num_threads: int | None = None) -> None:
        self.device = torch.device("cpu")
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.float().eval()

    def synchronize(self) -> None:
        pass
