"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention, a mixture of experts in place of the
MLP (layers/moe.py), dense MLP layers where ``mlp_only_layers`` / ``decoder_sparse_step``
say so.

Checkpoints name each expert's projections (``mlp.experts.{e}.gate_proj``, ``up_proj``,
``down_proj``); they load into the stacked ``mlp.w13_weight`` / ``mlp.w2_weight``. Mixtral
(models/mixtral.py) differs only in names, routing renormalization and attention.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from neuron_runtime.layers.activation import activation
from neuron_runtime.layers.moe import FusedMoE
from neuron_runtime.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from neuron_runtime.models.qwen3 import Qwen3Attention

# experts.{e}.{projection}.weight -> its part of the stacked expert weights
_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


def num_experts(cfg: dict[str, Any]) -> int:
    return int(cfg.get("num_experts") or cfg["num_local_experts"])


class MoEDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose MLP is a ``FusedMoE`` (or a dense MLP where the config
    keeps one)."""

    renormalize_key: str | None = "norm_topk_prob"  # config key; None: always renormalize

    def build_mlp(self, cfg: dict[str, Any], layer_idx: int) -> nn.Module:
        if not self.is_sparse(cfg, layer_idx):
            return LlamaMLP(cfg)
        key = self.renormalize_key
        return FusedMoE(
            num_experts(cfg),
            int(cfg["num_experts_per_tok"]),
            cfg["hidden_size"],
            int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            renormalize=True if key is None else bool(cfg.get(key, False)),
            act_fn=activation(cfg.get("hidden_act", "silu")),
        )

    @staticmethod
    def is_sparse(cfg: dict[str, Any], layer_idx: int) -> bool:
        return layer_idx not in (cfg.get("mlp_only_layers") or []) and (
            (layer_idx + 1) % int(cfg.get("decoder_sparse_step") or 1) == 0
        )


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int = 0,
        attention_cls: type[LlamaAttention] = Qwen3Attention,
    ) -> None:
        super().__init__(cfg, layer_idx, attention_cls)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """``Qwen3MoeForCausalLM`` (Qwen3-30B-A3B, Qwen3-235B-A22B and smaller configs)."""

    # checkpoint projection name -> part of the stacked weights (0 gate, 1 up, 2 down)
    expert_parts = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}
    layer_cls: type[MoEDecoderLayer] = Qwen3MoeDecoderLayer
    attention_cls: type[LlamaAttention] = Qwen3Attention

    def build_model(self, cfg: dict[str, Any]) -> LlamaModel:
        return LlamaModel(cfg, self.attention_cls, self.layer_cls)

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        match = _EXPERT.search(name)
        if match is None:
            return super().checkpoint_target(name)
        expert, proj = int(match.group(1)), match.group(2)
        part = self.expert_parts.get(proj)
        if part is None:
            return name, None  # load_weights reports it
        stacked = "w2_weight" if part == 2 else "w13_weight"
        return f"{name[: match.start()]}.{stacked}", expert * 3 + part

    def _shard_view(self, target: str, data: torch.Tensor, shard: int) -> torch.Tensor:
        module, _, param = target.rpartition(".")
        if param in ("w13_weight", "w2_weight"):
            moe = self.get_submodule(module)
            assert isinstance(moe, FusedMoE)
            return moe.shard_view(data, shard)
        return super()._shard_view(target, data, shard)

    def _expected_keys(self, params: dict[str, nn.Parameter]) -> set[str]:
        stacked = {n for n in params if n.endswith((".w13_weight", ".w2_weight"))}
        expected = super()._expected_keys({n: p for n, p in params.items() if n not in stacked})
        for name in stacked:
            module, _, param = name.rpartition(".")
            moe = self.get_submodule(module)
            assert isinstance(moe, FusedMoE)
            expected.update(f"{name}#{s}" for s in moe.expected_shards()[param])
        return expected
