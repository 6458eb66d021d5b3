"""Convert a llama.cpp GGUF file (Llama architecture) into a plain Hugging Face folder.

The weights are read and dequantized with the ``gguf`` package directly: going through
transformers' GGUF loader gives the same numbers but takes ~50 s for a 135M model. Only the
tokenizer goes through transformers, which already knows how to rebuild a fast tokenizer from
the GGUF vocabulary.

Output folder: ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32) and the
tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

# GGUF tensor name -> HF Llama name; "{}" is the layer index.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def convert_gguf_to_hf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> None:
    """Write an HF-format Llama checkpoint for ``gguf_path`` into the existing folder ``out_dir``.

    Raises ValueError if the file is not a Llama-architecture GGUF.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(gguf_path)
    meta = _read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported (only 'llama' is)"
        )

    tensors = _hf_tensors(reader, meta)
    config = _hf_config(
        meta,
        vocab_size=tensors["model.embed_tokens.weight"].shape[0],
        tie_word_embeddings="lm_head.weight" not in tensors,
    )
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _special_token_ids(meta))
    _save_tokenizer(gguf_path, meta, out_dir)


def _read_metadata(reader: GGUFReader) -> dict[str, Any]:
    # The vocabulary arrays (tokens, merges, scores) are large and only the tokenizer conversion
    # needs them; transformers reads those itself.
    skip = {
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type",
    }
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if name not in skip and not name.startswith("GGUF.")
    }


def _hf_tensors(reader: GGUFReader, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    n_head = int(meta["llama.attention.head_count"])
    n_kv_head = int(meta.get("llama.attention.head_count_kv", n_head))
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        # dequantize() turns the raw block bytes into a row-major array shaped like the HF weight,
        # [out_features, in_features]; tensor.shape is the GGUF (reversed) order and is not used.
        # np.array copies: unquantized tensors are read-only views of the memory-mapped file.
        weights = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            weights = _unpermute_rotary(weights, n_head)
        elif name.endswith("k_proj.weight"):
            weights = _unpermute_rotary(weights, n_kv_head)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(weights))
    return tensors


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        # e.g. rope_freqs.weight (Llama-3.1 rope scaling) or attention biases: refusing beats
        # writing a checkpoint that silently computes something else.
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama equivalent")
    layer, part = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.weight"


def _unpermute_rotary(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of q_proj / k_proj.

    HF Llama rotates the two halves of each head (rotate_half); llama.cpp rotates adjacent pairs,
    so its converter interleaves the halves: per head, rows [a0..a(d/2-1), b0..b(d/2-1)] became
    [a0, b0, a1, b1, ...]. Reading them as (d/2, 2) and swapping back restores the halves.
    """
    rows = weights.shape[0]
    head_dim = rows // n_head
    return (
        weights.reshape(n_head, head_dim // 2, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _hf_config(meta: dict[str, Any], vocab_size: int, tie_word_embeddings: bool) -> dict[str, Any]:
    n_head = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", n_head)),
        "head_dim": int(meta.get("llama.attention.key_length", hidden // n_head)),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        **_special_token_ids(meta),
    }
    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(meta["llama.rope.scaling.factor"]),
        }
        original = meta.get("llama.rope.scaling.original_context_length")
        if original is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = int(original)
    return config


def _special_token_ids(meta: dict[str, Any]) -> dict[str, int]:
    keys = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
    return {
        hf_key: int(meta[f"tokenizer.ggml.{gguf_key}_token_id"])
        for hf_key, gguf_key in keys.items()
        if f"tokenizer.ggml.{gguf_key}_token_id" in meta
    }


def _save_tokenizer(gguf_path: Path, meta: dict[str, Any], out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # Set it explicitly so the template survives even if a transformers version forgets to
    # carry tokenizer.chat_template over; it is saved as chat_template.jinja.
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out_dir)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
