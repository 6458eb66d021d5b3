"""Llama-family decoder (Llama 2/3.x, SmolLM2, ...) over the paged KV cache.

Module names follow HF checkpoint keys. q/k/v and gate/up projections are stored fused
(one GEMM instead of three or two), so ``load_weights`` maps each HF shard into its slice.

Other families (Qwen2/3, Mistral, Gemma 3) subclass these modules: ``LlamaAttention`` takes a
q/k/v bias option and has a ``rotate_qk`` hook (q/k norms) plus ``sliding_window`` and
``softcap`` attributes; ``LlamaForCausalLM.build_model`` swaps in their attention or layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from neuron_runtime.backends.ops import TORCH_OPS, Ops
from neuron_runtime.layers.activation import activation
from neuron_runtime.layers.attention import StepMetadata
from neuron_runtime.layers.linear import Linear
from neuron_runtime.layers.logits import LogitsHead
from neuron_runtime.layers.norm import RMSNorm
from neuron_runtime.layers.rotary import RotaryEmbedding, rope_parameters
from neuron_runtime.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    ParallelLogitsHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    """Self-attention of one layer over the paged cache.

    ``layer_idx`` lets families whose layers differ (sliding vs global) pick per layer;
    ``qkv_bias`` overrides the config's ``attention_bias`` for q/k/v only (Qwen2). Under
    tensor parallelism the layer holds this rank's heads (parallel/layers.py): ``num_heads``
    and ``num_kv_heads`` count those.
    """

    ops: Ops = TORCH_OPS

    def __init__(
        self, cfg: dict[str, Any], layer_idx: int = 0, qkv_bias: bool | None = None
    ) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        self.head_dim = cfg.get("head_dim") or hidden // num_heads
        self.scale = self.head_dim**-0.5
        bias = bool(cfg.get("attention_bias", False))
        qkv_bias = bias if qkv_bias is None else qkv_bias
        qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, qkv_bias)
        self.qkv_proj: Linear = qkv_proj
        shard = qkv_proj.heads
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_part = (shard.q_start * self.head_dim, self.q_size)
        self.o_proj = RowParallelLinear(q_part, hidden, bias=bias)
        self.sliding_window: int | None = None  # sees only the last this-many positions
        self.softcap: float | None = None  # tanh cap on attention scores (Gemma)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: StepMetadata,
    ) -> torch.Tensor:
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(x.shape[0], heads + 2 * kv_heads, self.head_dim)
        # q and k heads are adjacent: rotate them in one call.
        qk = self.rotate_qk(qkv[:, : heads + kv_heads], rope)
        q, k = qk.split([heads, kv_heads], dim=1)
        v = qkv[:, heads + kv_heads :]
        out = self.ops.attention(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window, self.softcap
        )
        return self.o_proj(out)

    def rotate_qk(
        self,
        qk: torch.Tensor,  # [T, qh + kvh, d]: q heads, then k heads
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Applies rotary positions to q and k; families with q/k norms override this."""
        return self.ops.rotary(qk, *rope)  # may work in place: qk is this layer's projection


class LlamaMLP(nn.Module):
    """Gated MLP, ``down(act(gate(x)) * up(x))``; ``hidden_act`` defaults to the config's."""

    ops: Ops = TORCH_OPS

    def __init__(self, cfg: dict[str, Any], hidden_act: str | None = None) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.act_fn = activation(hidden_act or cfg.get("hidden_act", "silu"))
        self.intermediate_size = inter
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], bias=False)
        self.intermediate_size_per_rank = self.gate_up_proj.output_sizes[0]
        self.down_proj = RowParallelLinear(self.gate_up_proj.parts[0], hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.act_and_mul(self.gate_up_proj(x), self.act_fn))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int = 0,
        attention_cls: type[LlamaAttention] = LlamaAttention,
    ) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = attention_cls(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = self.build_mlp(cfg, layer_idx)

    def build_mlp(self, cfg: dict[str, Any], layer_idx: int) -> nn.Module:
        """The layer's feed-forward block (mixture-of-experts layers override it)."""
        return LlamaMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: StepMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


# (config, layer index, attention class) -> decoder layer
LayerFactory = Callable[[dict[str, Any], int, type[LlamaAttention]], nn.Module]


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and the rotary tables they share."""

    def __init__(
        self,
        cfg: dict[str, Any],
        attention_cls: type[LlamaAttention] = LlamaAttention,
        layer_cls: LayerFactory = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(
            layer_cls(cfg, i, attention_cls) for i in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.rotary = RotaryEmbedding(
            head_dim, cfg.get("max_position_embeddings", 4096), rope_parameters(cfg)
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden], as the first layer takes them."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: StepMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: replaces the ids' embeddings
    ) -> torch.Tensor:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary.lookup(positions)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        x, _ = self.norm.add_and_norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """``LlamaForCausalLM``: hidden states for every token, logits only where asked."""

    # HF checkpoint name -> (our fused parameter, which slice)
    stacked_params = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.build_model(cfg)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head: ParallelLMHead | None = None
        if not self.tie_word_embeddings:
            # Only its weight is used, by logits_head (which keeps its own packed copy).
            self.lm_head = ParallelLMHead(cfg["hidden_size"], cfg["vocab_size"])
        self.logits_head: LogitsHead = ParallelLogitsHead(cfg["vocab_size"])

    def build_model(self, cfg: dict[str, Any]) -> LlamaModel:
        """The decoder stack; other families return theirs (another attention or layer)."""
        return LlamaModel(cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: StepMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_head(hidden, self.lm_head_weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            target, shard = self.checkpoint_target(name)
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            param = params[target]
            data = param.data
            dest = data if shard is None else self._shard_view(target, data, shard)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(target if shard is None else f"{target}#{shard}")
        expected = self._expected_keys(params)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}")
        self.logits_head.refresh(self.lm_head_weight)

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        """A checkpoint tensor's parameter here, and its part of a fused one (or None)."""
        for hf_name, (ours, shard) in self.stacked_params.items():
            if f".{hf_name}." in name:
                return name.replace(f".{hf_name}.", f".{ours}."), shard
        return name, None

    def _shard_view(self, target: str, data: torch.Tensor, shard: int) -> torch.Tensor:
        # The fused layer's parts on this rank: [q, k, v] or [gate, up] output sizes.
        owner: Any = self.get_submodule(target.rsplit(".", 2)[0])  # the attention or MLP
        if ".qkv_proj." in target:
            sizes = [owner.q_size, owner.kv_size, owner.kv_size]
        else:
            sizes = [owner.intermediate_size_per_rank] * 2
        start = sum(sizes[:shard])
        return data[start : start + sizes[shard]]

    def _expected_keys(self, params: dict[str, nn.Parameter]) -> set[str]:
        expected: set[str] = set()
        for name in params:
            if ".qkv_proj." in name:
                expected.update(f"{name}#{i}" for i in range(3))
            elif ".gate_up_proj." in name:
                expected.update(f"{name}#{i}" for i in range(2))
            else:
                expected.add(name)
        return expected
