"""Qwen3: Llama with an RMSNorm over each q and k head (before rotary); no biases by default."""

from __future__ import annotations

from typing import Any

import torch

from neuron_runtime.layers.norm import RMSNorm
from neuron_runtime.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from neuron_runtime.models.qwen2 import qwen_sliding_window


class Qwen3Attention(LlamaAttention):
    """Llama attention whose q and k heads are RMS-normalized over ``head_dim`` first."""

    def __init__(self, cfg: dict[str, Any], layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)
        self.sliding_window = qwen_sliding_window(cfg, layer_idx)

    def rotate_qk(
        self,
        qk: torch.Tensor,  # [T, qh + kvh, d]
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return self.ops.rotary(torch.cat((self.q_norm(q), self.k_norm(k)), dim=1), *rope)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """``Qwen3ForCausalLM`` (dense Qwen3), tied or untied embeddings."""

    def build_model(self, cfg: dict[str, Any]) -> LlamaModel:
        return LlamaModel(cfg, Qwen3Attention)
