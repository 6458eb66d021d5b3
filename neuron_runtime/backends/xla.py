"""XLA backend: the static runner on a torch-xla device (``PJRT_DEVICE``: CPU here, TPU or
Neuron elsewhere). torch_xla is imported when the backend is created, never before."""

from __future__ import annotations

import torch

from neuron_runtime.backends.ops import Ops
from neuron_runtime.backends.static.ops import STATIC_OPS


class XLABackend:
    name = "xla"
    graph_modes: tuple[str, ...] = ("lazy", "openxla")

    def __init__(self, num_threads: int | None = None, graph_mode: str = "lazy") -> None:
        self.prepare_environment()
        try:
            import torch_xla
        except ImportError as exc:
            raise ValueError(
                f"device {self.name!r} needs torch-xla, which is not installed ({exc})"
            ) from None
        self.device: torch.device = torch_xla.device()
        self.ops: Ops = STATIC_OPS
        if num_threads is not None:
            torch.set_num_threads(num_threads)

    def prepare_environment(self) -> None:
        """Sets what the device runtime reads when torch_xla is first imported."""

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.float().to(self.device).eval()
        self.ops.attach(model)
        return model

    def synchronize(self) -> None:
        import torch_xla

        torch_xla.sync()
