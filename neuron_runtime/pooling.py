"""Pooling: one vector per sequence from its hidden states, and the sentence-transformers config.

Every function takes right-padded hidden states ``[B, S, H]`` and a bool mask ``[B, S]``
(True on real tokens) and returns ``[B, H]``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Average over real tokens only; padding contributes nothing."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)  # [B, S, 1]
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)


def cls_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The first token ([CLS] for BERT-style tokenizers)."""
    return hidden[:, 0]


def last_token_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The last real token of each sequence (decoder embedding models, e.g. Qwen3-Embedding)."""
    last = mask.sum(dim=1) - 1  # [B], right padding puts it at length - 1
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


def l2_normalize(embeddings: torch.Tensor) -> torch.Tensor:
    """Unit length along the last dimension, so a dot product is the cosine similarity."""
    return F.normalize(embeddings, p=2, dim=-1)


POOLERS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mean": mean_pool,
    "cls": cls_pool,
    "last": last_token_pool,
}

# sentence-transformers 1_Pooling/config.json flag -> our pooling mode
_CONFIG_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}


def pooling_mode(model_path: str | Path) -> str:
    """The pooling a sentence-transformers folder declares in ``1_Pooling/config.json``.

    Folders without that file get ``"mean"``. ValueError if the config asks for a mode we do
    not implement (max, mean-sqrt-len, weighted mean) or for several modes concatenated.
    """
    config_file = Path(model_path) / "1_Pooling" / "config.json"
    if not config_file.is_file():
        return "mean"
    config = json.loads(config_file.read_text())
    flags = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    modes = [_CONFIG_FLAGS.get(flag, flag) for flag in flags]
    if len(modes) != 1 or modes[0] not in POOLERS:
        raise ValueError(
            f"{config_file} asks for pooling {modes}; supported: exactly one of {sorted(POOLERS)}"
        )
    return modes[0]
