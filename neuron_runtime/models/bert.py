"""BERT encoder (all-MiniLM, BGE, E5, ...): padded batches in, last hidden states out.

Module names follow HF checkpoint keys (``encoder.layer.N.attention.self.query``), so
``load_weights`` only strips the optional ``bert.`` prefix and skips what we do not run.
No KV cache: an encoder sees the whole input at once, so a batch is padded to its longest
member and the attention mask hides the padding.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# HF hidden_act -> the torch GELU variant it names
_GELU_APPROXIMATE = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], hidden)
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=cfg.get("layer_norm_eps", 1e-12))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, S, hidden]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # Every token is segment 0: embeddings encode single texts, never sentence pairs.
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings.weight[0]
        )
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.head_dim = hidden // self.num_heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(
        self,
        x: torch.Tensor,  # [B, S, hidden]
        mask: torch.Tensor,  # [B, 1, 1, S] bool, True where the key is a real token
    ) -> torch.Tensor:
        batch, seq_len, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, S, hidden] -> [B, H, S, D]
            return t.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.key(x)), heads(self.value(x)), attn_mask=mask
        )
        return out.transpose(1, 2).reshape(batch, seq_len, hidden)


class BertAddNorm(nn.Module):
    """``LayerNorm(residual + dense(x))``: HF's BertSelfOutput and BertOutput."""

    def __init__(self, in_features: int, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, cfg["hidden_size"])
        self.LayerNorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg.get("layer_norm_eps", 1e-12))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dense(x))


class BertAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertAddNorm(cfg["hidden_size"], cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        act = cfg.get("hidden_act", "gelu")
        if act not in _GELU_APPROXIMATE:
            raise ValueError(
                f"unsupported hidden_act {act!r} for BERT; supported: {sorted(_GELU_APPROXIMATE)}"
            )
        self.approximate = _GELU_APPROXIMATE[act]
        self.dense = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x), approximate=self.approximate)


class BertLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertAddNorm(cfg["intermediate_size"], cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg["num_hidden_layers"]))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, mask)
        return x


class BertModel(nn.Module):
    """HF ``BertModel`` without the pooler; ``forward`` returns the last hidden states."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        position_type = cfg.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"unsupported position_embedding_type {position_type!r} for BERT")
        if cfg["hidden_size"] % cfg["num_attention_heads"]:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S], padded
        attention_mask: torch.Tensor,  # [B, S] bool, False on padding
    ) -> torch.Tensor:  # [B, S, hidden]
        mask = attention_mask[:, None, None, :]  # broadcast over heads and query positions
        return self.encoder(self.embeddings(input_ids), mask)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            # The pooler (tanh head for next-sentence prediction) and MLM head are unused by
            # embeddings; position_ids is a buffer older checkpoints saved.
            if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in BertModel")
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                    f"model shape {tuple(params[name].shape)}"
                )
            params[name].data.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(
                f"checkpoint lacks {len(missing)} BertModel weights, e.g. {missing[0]}"
            )
