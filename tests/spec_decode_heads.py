"""Random-weight EAGLE and EAGLE-3 heads saved in their published checkpoint layouts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def _layer(prefix: str, hidden: int, inter: int, q: int, kv: int, attn_in: int) -> dict:
    w = {
        f"{prefix}self_attn.q_proj.weight": (q, attn_in),
        f"{prefix}self_attn.k_proj.weight": (kv, attn_in),
        f"{prefix}self_attn.v_proj.weight": (kv, attn_in),
        f"{prefix}self_attn.o_proj.weight": (hidden, q),
        f"{prefix}mlp.gate_proj.weight": (inter, hidden),
        f"{prefix}mlp.up_proj.weight": (inter, hidden),
        f"{prefix}mlp.down_proj.weight": (hidden, inter),
        f"{prefix}post_attention_layernorm.weight": (hidden,),
    }
    return w


def make_eagle_head(out: Path, target_config: dict, method: str, seed: int = 0) -> Path:
    """A head for ``target_config`` (an HF config dict): ``eagle`` or ``eagle3`` layout."""
    hidden = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    kv_heads = target_config.get("num_key_value_heads") or heads
    head_dim = hidden // heads
    inter = target_config["intermediate_size"]
    vocab = target_config["vocab_size"]
    q, kv = heads * head_dim, kv_heads * head_dim
    cfg = {
        k: target_config[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "rms_norm_eps",
            "max_position_embeddings",
            "vocab_size",
        )
        if k in target_config
    }
    cfg["num_hidden_layers"] = 1
    if method == "eagle":
        shapes = {"fc.weight": (hidden, 2 * hidden), "fc.bias": (hidden,)}
        shapes.update(_layer("layers.0.", hidden, inter, q, kv, hidden))
        shapes["embed_tokens.weight"] = (vocab, hidden)
        cfg["architectures"] = ["EagleLlamaForCausalLM"]
    else:
        draft_vocab = 512
        shapes = {"fc.weight": (hidden, 3 * hidden)}
        shapes.update(_layer("midlayer.", hidden, inter, q, kv, 2 * hidden))
        shapes["midlayer.input_layernorm.weight"] = (hidden,)
        shapes["midlayer.hidden_norm.weight"] = (hidden,)
        shapes["norm.weight"] = (hidden,)
        shapes["lm_head.weight"] = (draft_vocab, hidden)
        cfg["architectures"] = ["LlamaForCausalLMEagle3"]
        cfg["draft_vocab_size"] = draft_vocab
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = 1 + 0.1 * torch.randn(shape, generator=gen)
        else:
            tensors[name] = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
    if method == "eagle3":
        # Draft id i -> target id: every 7th target token (d2t holds the offset).
        draft_ids = torch.arange(draft_vocab)
        tensors["d2t"] = draft_ids * 7 - draft_ids
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[draft_ids * 7] = True
        tensors["t2d"] = t2d
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg))
    return out
