"""Convert a llama.cpp GGUF file (Llama or Gemma 3 architecture) into a plain HF folder.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

# GGUF per-layer tensor name -> HF name inside ``model.layers.{i}``.
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
# Gemma 3 norms around attention and MLP; its ffn_norm is the norm before the MLP.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass(frozen=True)
class _Arch:
    """How one llama.cpp architecture maps back to its HF checkpoint."""

    layer_names: dict[str, str]
    # llama.cpp interleaves the rotary halves of q/k rows for Llama (not for NeoX-style rope).
    permute_rotary: bool
    # llama.cpp stores Gemma's RMSNorm weights as 1 + weight (HF keeps the bare weight).
    norm_offset: float
    hf_config: Callable[[dict[str, Any], int, bool], dict[str, Any]]


def convert_gguf_to_hf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> None:
    """Write an HF-format checkpoint for ``gguf_path`` into the existing folder ``out_dir``.

    Raises ValueError if the file's architecture is not one of ``_ARCHS`` (llama, gemma3).
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(gguf_path)
    meta = _read_metadata(reader)
    arch_name = meta.get("general.architecture")
    arch = _ARCHS.get(str(arch_name))
    if arch is None:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {arch_name!r} is not supported "
            f"(supported: {', '.join(sorted(_ARCHS))})"
        )

    tensors = _hf_tensors(reader, meta, arch)
    config = arch.hf_config(
        meta,
        tensors["model.embed_tokens.weight"].shape[0],
        "lm_head.weight" not in tensors,
    )
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _special_token_ids(meta))
    _save_tokenizer(gguf_path, meta, out_dir)


@dataclass(frozen=True)
class QuantizedTensor:
    """A 2-D GGUF tensor's raw blocks, ``blocks`` uint8 ``[rows, bytes per row]`` in the HF
    weight's row order (q/k rows un-permuted as ``convert_gguf_to_hf`` does)."""

    ggml_type: str  # "Q4_1", "Q8_0", "Q4_K", ...
    blocks: np.ndarray
    rows: int
    width: int


def quantized_tensors(gguf_path: str | os.PathLike[str]) -> dict[str, QuantizedTensor]:
    """The quantized 2-D tensors of a GGUF file by HF name, undequantized (the blocks are
    views of the memory-mapped file, except for permuted q/k rows)."""
    reader = GGUFReader(gguf_path)
    meta = _read_metadata(reader)
    arch = _ARCHS[str(meta["general.architecture"])]
    prefix = meta["general.architecture"]
    n_head = int(meta[f"{prefix}.attention.head_count"])
    n_kv_head = int(meta.get(f"{prefix}.attention.head_count_kv", n_head))
    found: dict[str, QuantizedTensor] = {}
    for tensor in reader.tensors:
        if len(tensor.shape) != 2 or tensor.tensor_type.name in ("F32", "F16", "BF16"):
            continue
        name = _hf_name(tensor.name, arch.layer_names)
        width, rows = int(tensor.shape[0]), int(tensor.shape[1])  # GGUF order: [in, out]
        blocks = np.asarray(tensor.data).reshape(rows, -1)
        if arch.permute_rotary and name.endswith("q_proj.weight"):
            blocks = _unpermute_rotary(blocks, n_head)
        elif arch.permute_rotary and name.endswith("k_proj.weight"):
            blocks = _unpermute_rotary(blocks, n_kv_head)
        found[name] = QuantizedTensor(tensor.tensor_type.name, blocks, rows, width)
    return found


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


def _hf_tensors(reader: GGUFReader, meta: dict[str, Any], arch: _Arch) -> dict[str, torch.Tensor]:
    prefix = meta["general.architecture"]
    n_head = int(meta[f"{prefix}.attention.head_count"])
    n_kv_head = int(meta.get(f"{prefix}.attention.head_count_kv", n_head))
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, arch.layer_names)
        # dequantize() turns the raw block bytes into a row-major array shaped like the HF weight,
        # [out_features, in_features]; tensor.shape is the GGUF (reversed) order and is not used.
        # np.array copies: unquantized tensors are read-only views of the memory-mapped file.
        weights = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if arch.permute_rotary and name.endswith("q_proj.weight"):
            weights = _unpermute_rotary(weights, n_head)
        elif arch.permute_rotary and name.endswith("k_proj.weight"):
            weights = _unpermute_rotary(weights, n_kv_head)
        elif name.endswith("norm.weight"):
            weights -= arch.norm_offset
        tensors[name] = torch.from_numpy(np.ascontiguousarray(weights))
    return tensors


def _hf_name(gguf_name: str, layer_names: dict[str, str]) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in layer_names:
        # e.g. rope_freqs.weight (Llama-3.1 rope scaling) or attention biases: refusing beats
        # writing a checkpoint that silently computes something else.
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent")
    layer, part = match.groups()
    return f"model.layers.{layer}.{layer_names[part]}.weight"


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


def _llama_config(
    meta: dict[str, Any], vocab_size: int, tie_word_embeddings: bool
) -> dict[str, Any]:
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


def _gemma3_config(
    meta: dict[str, Any], vocab_size: int, tie_word_embeddings: bool
) -> dict[str, Any]:
    # Keys llama.cpp does not store for Gemma 3 take the values it hard-codes: local rope base
    # 10000, one global layer in six, and queries scaled by head_dim (hidden / heads for 27B,
    # the 62-layer model).
    n_head = int(meta["gemma3.attention.head_count"])
    hidden = int(meta["gemma3.embedding_length"])
    num_layers = int(meta["gemma3.block_count"])
    head_dim = int(meta.get("gemma3.attention.key_length", 256))
    config: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "torch_dtype": "float32",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(meta["gemma3.feed_forward_length"]),
        "num_hidden_layers": num_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get("gemma3.attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta["gemma3.context_length"]),
        "rms_norm_eps": float(meta["gemma3.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get("gemma3.rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
        "sliding_window": int(meta["gemma3.attention.sliding_window"]),
        "layer_types": [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)
        ],
        "query_pre_attn_scalar": hidden // n_head if num_layers == 62 else head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "final_logit_softcapping": meta.get("gemma3.final_logit_softcapping"),
        "attn_logit_softcapping": meta.get("gemma3.attn_logit_softcapping"),
        "tie_word_embeddings": tie_word_embeddings,
        **_special_token_ids(meta),
    }
    scaling = meta.get("gemma3.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(meta["gemma3.rope.scaling.factor"]),
        }
    return config


_ARCHS = {
    "llama": _Arch(_LAYER_NAMES, permute_rotary=True, norm_offset=0.0, hf_config=_llama_config),
    "gemma3": _Arch(
        _GEMMA3_LAYER_NAMES, permute_rotary=False, norm_offset=1.0, hf_config=_gemma3_config
    ),
}


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
