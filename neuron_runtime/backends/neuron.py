"""Neuron backend: the static runner on NeuronCores through torch-neuronx (an XLA device).

A replica owns the NeuronCores Ray gave it: Ray's accelerator manager sets
``NEURON_RT_VISIBLE_CORES`` (``"0-3"`` or ``"0,1"``) for an actor that asks for the
``neuron_cores`` resource. Before torch_xla is imported, the backend derives the rest of the
Neuron runtime's environment from it (``neuron_environment``); what the user set is kept.
The Neuron packages (torch-neuronx, neuronx-cc) are not on PyPI: creating this backend
without them raises a ValueError that says so.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from neuron_runtime.backends.xla import XLABackend
from neuron_runtime.model_store import cache_dir

# neuronx-cc flags for decoder LLMs; NEURON_CC_FLAGS in the environment replaces them.
DEFAULT_CC_FLAGS = "--model-type=transformer --auto-cast=none -O1"


def parse_visible_cores(value: str) -> list[int]:
    """``"0-3"`` -> [0, 1, 2, 3]; ``"0,1"`` -> [0, 1]; ``"0-1,4"`` -> [0, 1, 4]."""
    cores: list[int] = []
    for part in value.replace(" ", "").split(","):
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise ValueError(
                f"NEURON_RT_VISIBLE_CORES {value!r} is not like '0-3' or '0,1'"
            ) from None
        if lo < 0 or hi < lo:
            raise ValueError(f"NEURON_RT_VISIBLE_CORES {value!r} has an empty or negative range")
        cores.extend(range(lo, hi + 1))
    if len(set(cores)) != len(cores):
        raise ValueError(f"NEURON_RT_VISIBLE_CORES {value!r} names a core twice")
    return cores


def neuron_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables to set before torch_xla is imported, given the process environment."""
    out = {
        "PJRT_DEVICE": "NEURON",
        # trn1: one physical core per logical core; trn2 groups two (LNC=2) by default.
        "NEURON_LOGICAL_NC_CONFIG": env.get("NEURON_LOGICAL_NC_CONFIG", "1"),
        "NEURON_CC_FLAGS": env.get("NEURON_CC_FLAGS", DEFAULT_CC_FLAGS),
        "NEURON_COMPILE_CACHE_URL": env.get(
            "NEURON_COMPILE_CACHE_URL", str(cache_dir() / "neuron-compile-cache")
        ),
    }
    visible = env.get("NEURON_RT_VISIBLE_CORES")
    if visible is not None:
        cores = parse_visible_cores(visible)
        out["NEURON_RT_VISIBLE_CORES"] = ",".join(map(str, cores))
        out["NEURON_RT_NUM_CORES"] = str(len(cores))
    return out


class NeuronBackend(XLABackend):
    name = "neuron"
    graph_modes = ("neuronx", "lazy", "openxla")

    def __init__(self, num_threads: int | None = None, graph_mode: str = "neuronx") -> None:
        super().__init__(num_threads, graph_mode)

    def prepare_environment(self) -> None:
        os.environ.update(neuron_environment(os.environ))
        try:
            import torch_neuronx  # noqa: F401 (registers the Neuron PJRT plugin)
        except ImportError as exc:
            raise ValueError(
                "device 'neuron' needs the Neuron SDK's torch-neuronx (not on PyPI; install it "
                f"from the Neuron repository on a Trainium host): {exc}"
            ) from None
