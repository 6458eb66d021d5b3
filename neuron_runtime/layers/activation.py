"""MLP activations by their HF config names (``hidden_act`` / ``hidden_activation``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """OpenAI CLIP's GELU approximation, ``x * sigmoid(1.702 x)``."""
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function HF calls ``name``; ValueError names the supported ones."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unsupported activation {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}"
        ) from None
