"""Mistral: Llama whose every layer attends within ``sliding_window`` (None: full attention)."""

from __future__ import annotations

from typing import Any

from neuron_runtime.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel


class MistralAttention(LlamaAttention):
    """Llama attention limited to the last ``sliding_window`` positions."""

    def __init__(self, cfg: dict[str, Any], layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        window = cfg.get("sliding_window")
        self.sliding_window = None if window is None else int(window)


class MistralForCausalLM(LlamaForCausalLM):
    """``MistralForCausalLM`` (Mistral 7B v0.1-v0.3 and relatives)."""

    def build_model(self, cfg: dict[str, Any]) -> LlamaModel:
        return LlamaModel(cfg, MistralAttention)
