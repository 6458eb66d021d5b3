"""Rotary position embeddings (the half-split layout HF Llama uses), with rope scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_parameters(
    hf_config: dict[str, Any], layer_type: str = "full_attention"
) -> dict[str, Any]:
    """Rope settings from either config spelling: ``rope_parameters`` or ``rope_theta`` +
    ``rope_scaling``.

    Models whose layer types rotate differently (Gemma 3) nest ``rope_parameters`` by layer
    type; ``layer_type`` picks one.
    """
    params = dict(hf_config.get("rope_parameters") or {})
    if layer_type in params:
        params = dict(params[layer_type] or {})
    scaling = hf_config.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, params)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


def _llama3_frequencies(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band in
    # between interpolated linearly in 1/wavelength.
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Holds cos/sin tables; ``lookup`` once per step, ``apply`` in every layer."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, params)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", angles.cos().float(), persistent=False)  # [P, d/2]
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, d/2]: broadcast over heads
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, d]; rotates the two halves of the head dimension as pairs."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
