"""Mixtral (``MixtralForCausalLM``): Mistral attention and a mixture of experts in every
layer, its top-k routing weights always renormalized to sum 1.

Checkpoints keep the experts under ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up)
and ``w2`` (down), the router under ``block_sparse_moe.gate``; they load into the same
``mlp`` (layers/moe.py ``FusedMoE``) as Qwen3-MoE's.
"""

from __future__ import annotations

from typing import Any

from neuron_runtime.models.llama import LlamaAttention
from neuron_runtime.models.mistral import MistralAttention
from neuron_runtime.models.qwen3_moe import MoEDecoderLayer, Qwen3MoeForCausalLM


class MixtralDecoderLayer(MoEDecoderLayer):
    renormalize_key = None

    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int = 0,
        attention_cls: type[LlamaAttention] = MistralAttention,
    ) -> None:
        super().__init__(cfg, layer_idx, attention_cls)

    @staticmethod
    def is_sparse(cfg: dict[str, Any], layer_idx: int) -> bool:
        return True


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    """``MixtralForCausalLM`` (Mixtral 8x7B, 8x22B and smaller configs)."""

    expert_parts = {"w1": 0, "w3": 1, "w2": 2}
    layer_cls = MixtralDecoderLayer
    attention_cls = MistralAttention

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        return super().checkpoint_target(name.replace(".block_sparse_moe.", ".mlp."))
