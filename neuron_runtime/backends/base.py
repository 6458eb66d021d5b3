"""The device interface the engine runs on, and a registry of implementations.

Device libraries are imported only inside the implementation that needs them, when it is
created, so the engine imports on any machine.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from neuron_runtime.backends.ops import Ops

# name -> "module:Class", imported on first use
_BACKENDS = {
    "cpu": "neuron_runtime.backends.cpu:CPUBackend",
    "cuda": "neuron_runtime.backends.cuda:CUDABackend",
    "xla": "neuron_runtime.backends.xla:XLABackend",
    "neuron": "neuron_runtime.backends.neuron:NeuronBackend",
}


class Backend(Protocol):
    """Where tensors live and how the model runs there."""

    name: str
    graph_modes: tuple[str, ...]  # the graph modes it runs; the first is its default
    device: torch.device
    ops: Ops  # what the model's layers, attention and the greedy sampler run on

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Moves a loaded model onto the device and readies it for inference."""
        ...

    def synchronize(self) -> None:
        """Waits for queued device work (a no-op where execution is eager)."""
        ...


def backend_class(name: str) -> type[Backend]:
    """The named backend's class (imports its module, not its device libraries)."""
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; choose one of {sorted(_BACKENDS)}") from None
    module_name, cls_name = target.split(":")
    cls: type[Backend] = getattr(importlib.import_module(module_name), cls_name)
    return cls


def default_graph_mode(device: str) -> str:
    """The graph mode a device runs when none is asked for (eager on CPU and CUDA)."""
    return backend_class(device).graph_modes[0]


def get_backend(
    name: str, num_threads: int | None = None, graph_mode: str = "eager", dtype: str = "float32"
) -> Backend:
    """Creates the named backend for ``graph_mode`` and the linear layers' ``dtype``
    (ModelConfig.dtype); ValueError names the choices."""
    cls = backend_class(name)
    if graph_mode not in cls.graph_modes:
        raise ValueError(
            f"device {name!r} runs graph_mode {', '.join(cls.graph_modes)}, not {graph_mode!r}"
        )
    if dtype == "float32":
        return cls(num_threads=num_threads, graph_mode=graph_mode)  # type: ignore[call-arg]
    if dtype not in getattr(cls, "dtypes", ("float32",)):
        raise ValueError(f"device {name!r} runs dtype float32 only, not {dtype!r}")
    return cls(num_threads=num_threads, graph_mode=graph_mode, dtype=dtype)  # type: ignore[call-arg]
