"""Qwen2 / Qwen2.5: Llama with biases on q/k/v (not o_proj) and optional sliding-window layers."""

from __future__ import annotations

from typing import Any

from neuron_runtime.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel


def qwen_sliding_window(cfg: dict[str, Any], layer_idx: int) -> int | None:
    """The window of layer ``layer_idx`` under Qwen2/Qwen3 config rules, None for full attention.

    Windows apply only with ``use_sliding_window``; which layers slide comes from
    ``layer_types`` or, in older configs, from ``max_window_layers`` (layers from it on slide).
    """
    if not cfg.get("use_sliding_window") or cfg.get("sliding_window") is None:
        return None
    layer_types = cfg.get("layer_types")
    if layer_types:
        sliding = layer_types[layer_idx] == "sliding_attention"
    else:
        sliding = layer_idx >= cfg.get("max_window_layers", 28)
    return int(cfg["sliding_window"]) if sliding else None


class Qwen2Attention(LlamaAttention):
    """Llama attention with q/k/v biases."""

    def __init__(self, cfg: dict[str, Any], layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx, qkv_bias=True)
        self.sliding_window = qwen_sliding_window(cfg, layer_idx)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """``Qwen2ForCausalLM`` (Qwen2, Qwen2.5), tied or untied embeddings."""

    def build_model(self, cfg: dict[str, Any]) -> LlamaModel:
        return LlamaModel(cfg, Qwen2Attention)
