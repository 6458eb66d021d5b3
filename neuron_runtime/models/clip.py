"""CLIP vision tower (``CLIPVisionModel``): a ViT over image patches, in plain torch.

    pixels [B, 3, S, S] -> conv patches (stride = patch) -> [CLS] + patches + positions
      -> pre_layrnorm -> encoder layers (pre-norm attention and MLP) -> post_layernorm(CLS)

A LLaVA model reads the hidden states of one or more encoder layers (usually the second to
last), so ``num_layers`` builds only the layers it needs and checkpoint weights of the rest
(and the post-layernorm) are skipped, as vLLM does. Module names follow HF checkpoint keys;
``load_weights`` takes them with or without the ``vision_model.`` prefix of older
transformers versions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from neuron_runtime.layers.activation import activation
from neuron_runtime.loader import copy_weights

# CLIPVisionConfig defaults for keys a sparse config.json leaves out (llava-1.5's does).
CLIP_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, patch = cfg["hidden_size"], cfg["patch_size"]
        self.image_size = cfg["image_size"]
        self.class_embedding = nn.Parameter(torch.zeros(hidden))
        self.patch_embedding = nn.Conv2d(
            cfg["num_channels"], hidden, kernel_size=patch, stride=patch, bias=False
        )
        num_positions = (self.image_size // patch) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(
                f"images must be {self.image_size}x{self.image_size} pixels, got {height}x{width}"
            )
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # [B, P, H]
        cls = self.class_embedding.expand(batch, 1, -1)
        return torch.cat((cls, patches), dim=1) + self.position_embedding.weight  # [B, 1+P, H]


class CLIPAttention(nn.Module):
    """Bidirectional multi-head attention over one image's tokens."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.head_dim = hidden // self.num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, N, H] -> [B, heads, N, d]
            return t.view(batch, tokens, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        )
        return self.out_proj(out.transpose(1, 2).reshape(batch, tokens, hidden))


class CLIPMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.activation_fn = activation(cfg["hidden_act"])
        self.fc1 = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"])
        self.fc2 = nn.Linear(cfg["intermediate_size"], cfg["hidden_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = CLIPAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = CLIPMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, cfg: dict[str, Any], num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(num_layers))


class CLIPVisionModel(nn.Module):
    """``CLIPVisionModel``; ``num_layers`` (default: all) builds only the first layers."""

    def __init__(self, cfg: dict[str, Any], num_layers: int | None = None) -> None:
        super().__init__()
        cfg = {**CLIP_VISION_DEFAULTS, **cfg}
        self.config = cfg
        total = cfg["num_hidden_layers"]
        num_layers = total if num_layers is None else num_layers
        if not 0 <= num_layers <= total:
            raise ValueError(f"num_layers must be in [0, {total}], got {num_layers}")
        self.patch_size = cfg["patch_size"]
        self.num_patches = (cfg["image_size"] // self.patch_size) ** 2
        self.embeddings = CLIPVisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])
        self.encoder = CLIPEncoder(cfg, num_layers)
        # The pooled CLS output needs the last layer; a truncated tower has none.
        self.post_layernorm = (
            nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])
            if num_layers == total
            else None
        )

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """Hidden states as HF's ``hidden_states``: the embeddings (after pre_layrnorm), then
        each built layer's output; each [B, 1 + num_patches, hidden]."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return states

    def pool(self, last_hidden_state: torch.Tensor) -> torch.Tensor:
        """HF's ``pooler_output``: the post-layernormed CLS token, [B, hidden]."""
        if self.post_layernorm is None:
            raise ValueError("a truncated CLIP tower has no pooled output")
        return self.post_layernorm(last_hidden_state[:, 0])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        names = ((name.removeprefix("vision_model."), tensor) for name, tensor in weights)
        copy_weights(
            self,
            ((n, t) for n, t in names if self.wants_weight(n) and not n.endswith("position_ids")),
            "CLIP vision tower",
        )

    def wants_weight(self, name: str) -> bool:
        """False for checkpoint tensors of layers (or the post-layernorm) this tower skips."""
        name = name.removeprefix("vision_model.")
        if name.startswith("post_layernorm."):
            return self.post_layernorm is not None
        if name.startswith("encoder.layers."):
            return int(name.split(".")[2]) < len(self.encoder.layers)
        return True
