"""The device interface the engine runs on, and a registry of implementations.

Device libraries are imported only inside the implementation that needs them, when it is
created, so the engine imports on any machine.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from neuron_runtime.backends.cpu_kernels import CPUKernels

# name -> "module:Class", imported on first use
_BACKENDS = {
    "cpu": "neuron_runtime.backends.cpu:CPUBackend",
    "cuda": "neuron_runtime.backends.cuda:CUDABackend",
}


class Backend(Protocol):
    """Where tensors live and how the model runs there."""

    name: str
    device: torch.device
    kernels: CPUKernels | None  # fused CPU kernels the model's layers and attention use

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Moves a loaded model onto the device and readies it for inference."""
        ...

    def synchronize(self) -> None:
        """Waits for queued device work (a no-op where execution is eager)."""
        ...


def get_backend(name: str, num_threads: int | None = None) -> Backend:
    """Creates the named backend; ValueError names the choices."""
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; choose one of {sorted(_BACKENDS)}") from None
    module_name, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(num_threads=num_threads)
