"""Gemma 3 text decoder (``Gemma3ForCausalLM``), as differences from Llama and Qwen3.

- RMSNorms scale by ``1 + weight``: ``load_weights`` adds the 1 once, so the plain RMSNorm
  serves (our norm parameters hold ``1 + checkpoint weight``).
- Four norms per layer: before and after attention, before and after the MLP.
- Embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the embedding dtype, as HF).
- q/k heads are RMS-normalized (Qwen3's hook); scores scale by ``query_pre_attn_scalar**-0.5``.
- Layers are ``sliding_attention`` (window, local rope base ``rope_local_base_freq``) or
  ``full_attention`` (global rope, maybe scaled), per ``layer_types`` or, in older configs,
  every ``sliding_window_pattern``-th layer global.
- ``gelu_pytorch_tanh`` MLP; optional tanh soft-capping of attention scores and final logits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from neuron_runtime.layers.attention import StepMetadata
from neuron_runtime.layers.norm import RMSNorm
from neuron_runtime.layers.rotary import RotaryEmbedding, rope_parameters
from neuron_runtime.models.llama import (
    KVCache,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from neuron_runtime.models.qwen3 import Qwen3Attention

# Gemma3TextConfig defaults that differ from what the Llama code assumes when a key is absent.
_DEFAULTS: dict[str, Any] = {
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "head_dim": 256,
    "sliding_window": 4096,
    "max_position_embeddings": 131_072,
}


def is_sliding(cfg: dict[str, Any], layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` is a local (sliding-window) layer."""
    layer_types = cfg.get("layer_types")
    if layer_types:
        return layer_types[layer_idx] == "sliding_attention"
    return (layer_idx + 1) % int(cfg.get("sliding_window_pattern", 6)) != 0


def local_rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rope settings of the sliding layers, from either config spelling."""
    if "sliding_attention" in (cfg.get("rope_parameters") or {}):
        return rope_parameters(cfg, "sliding_attention")
    return {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}


class Gemma3Attention(Qwen3Attention):
    """Qwen3's q/k-normed attention with Gemma's score scale, window and soft-capping."""

    def __init__(self, cfg: dict[str, Any], layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        self.scale = float(cfg["query_pre_attn_scalar"]) ** -0.5
        self.sliding_window = int(cfg["sliding_window"]) if is_sliding(cfg, layer_idx) else None
        cap = cfg.get("attn_logit_softcapping")
        self.softcap = None if cap is None else float(cap)


class Gemma3DecoderLayer(torch.nn.Module):
    """Pre- and post-norms around both attention and MLP; residual adds between them."""

    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int = 0,
        attention_cls: type[LlamaAttention] = Gemma3Attention,
    ) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = attention_cls(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp = LlamaMLP(cfg, cfg["hidden_activation"])
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: StepMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Same contract as LlamaDecoderLayer: the caller adds the returned x to the residual.
        x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, rope, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm.add_and_norm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(LlamaModel):
    """Scaled embeddings; global layers use ``rotary``, sliding ones ``local_rotary``."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg, Gemma3Attention, Gemma3DecoderLayer)
        num_layers = cfg["num_hidden_layers"]
        self.sliding = [is_sliding(cfg, i) for i in range(num_layers)]
        self.local_rotary = RotaryEmbedding(
            cfg["head_dim"], cfg["max_position_embeddings"], local_rope_parameters(cfg)
        )
        scale = torch.tensor(cfg["hidden_size"] ** 0.5, dtype=self.embed_tokens.weight.dtype)
        self.embed_scale: torch.Tensor
        self.register_buffer("embed_scale", scale, persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: StepMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden], already scaled
    ) -> torch.Tensor:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        global_rope = self.rotary.lookup(positions)
        local_rope = self.local_rotary.lookup(positions)
        residual: torch.Tensor | None = None
        for layer, sliding, kv_cache in zip(self.layers, self.sliding, kv_caches, strict=True):
            rope = local_rope if sliding else global_rope
            x, residual = layer(x, residual, rope, kv_cache, meta)
        x, _ = self.norm.add_and_norm(x, residual)
        return x


class Gemma3ForCausalLM(LlamaForCausalLM):
    """``Gemma3ForCausalLM``: the text-only Gemma 3 (270m, 1b) or a Gemma 3 text config."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("Gemma 3 with use_bidirectional_attention is not supported")
        cfg = {**_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
        super().__init__(cfg)
        cap = cfg.get("final_logit_softcapping")
        self.final_softcap = None if cap is None else float(cap)

    def build_model(self, cfg: dict[str, Any]) -> LlamaModel:
        return Gemma3Model(cfg)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Gemma's norms compute x_normed * (1 + weight); store 1 + weight for the plain RMSNorm.
        super().load_weights(
            (name, tensor + 1 if name.endswith("norm.weight") else tensor)
            for name, tensor in weights
        )
