"""The CPU kernels on GGUF Q4_1 / Q8_0 blocks: exact against gguf's own dequantizer, mapped
onto the model's fused layers like the converted fp32 checkpoint, and the engine on them
against transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file
from test_llama_vs_hf import hf_greedy, hf_model

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.backends import cpu_kernels
from neuron_runtime.backends.cpu_kernels import QuantizedPanels
from neuron_runtime.backends.cpu_ops import CPUKernelOps
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.gguf_convert import QuantizedTensor
from neuron_runtime.layers.linear import Linear
from neuron_runtime.loader import load_model
from neuron_runtime.models.registry import model_class

FORMATS = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
DEFAULT = "smollm2-135m-instruct"


def _quantized(fmt: str, out: int, width: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """GGUF blocks of a random [out, width] weight, and gguf's dequantization of them."""
    w = np.random.default_rng(seed).standard_normal((out, width)).astype(np.float32)
    blocks = quantize(w, FORMATS[fmt])
    return blocks, torch.from_numpy(np.array(dequantize(blocks, FORMATS[fmt]), np.float32))


def _pack(k: cpu_kernels.CPUKernels, fmt: str, blocks, out: int, width: int) -> QuantizedPanels:
    return k.pack_q4_1(blocks, out, width) if fmt == "q4_1" else k.pack_q8_0(blocks, out, width)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("out,width", [(1, 32), (67, 96), (130, 64)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 15, 17, 64, 70])
def test_identity_rows_give_the_dequantized_weight_bit_for_bit(k, fmt, out, width, rows):
    """Row r of x is the unit vector e_(r mod width): every other product is 0, so y[r] is
    column r of W^T exactly, whatever the summation order."""
    blocks, w = _quantized(fmt, out, width, seed=out + rows)
    x = torch.eye(width)[torch.arange(rows) % width].contiguous()
    y = k.linear(x, _pack(k, fmt, blocks, out, width), None, out)
    assert torch.equal(y, w.T[torch.arange(rows) % width])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 4, 12, 13, 70, 128])
def test_random_rows_match_torch_on_the_dequantized_weight(k, fmt, rows):
    out, width = 100, 160
    blocks, w = _quantized(fmt, out, width, seed=rows)
    x, bias = torch.randn(rows, width), torch.randn(out)
    packed = _pack(k, fmt, blocks, out, width)
    y = k.linear(x, packed, bias, out)
    torch.testing.assert_close(y, x @ w.T + bias, atol=1e-4, rtol=1e-5)
    if rows % 4 == 0:
        # Tiles of 8 and 4 rows (64-row blocks through the dequantized-panel buffer): same
        # weights and order of sums as the fp32 panels, so the same bits.
        assert torch.equal(y, k.linear(x, k.pack(w), bias, out))


def test_pack_refuses_blocks_that_do_not_fit(k):
    blocks, _ = _quantized("q4_1", 4, 64, seed=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        k.pack_q4_1(blocks, 4, 48)
    with pytest.raises(ValueError, match="do not hold"):
        k.pack_q4_1(blocks, 5, 64)
    with pytest.raises(ValueError, match="do not hold"):
        k.pack_q8_0(blocks, 4, 64)  # Q4_1 bytes read as Q8_0


def test_unsupported_types_fall_back_to_fp32(k):
    ops = CPUKernelOps(k)
    blocks, _ = _quantized("q8_0", 64, 64, seed=0)
    q4_k = QuantizedTensor("Q4_K", blocks, 64, 64)
    q8_0 = QuantizedTensor("Q8_0", blocks, 64, 64)
    assert ops._pack([q4_k], 64, 64) is None
    assert ops._pack([q8_0, q4_k], 128, 64) is None  # mixed parts of one fused layer
    assert ops._pack([q8_0], 65, 64) is None  # not the layer's shape
    panels = ops._pack([q8_0, q8_0], 128, 64)
    assert panels is not None and panels.format == "q8_0"


def _default_model(quantization: str | None):
    config = EngineArgs(model=DEFAULT, max_model_len=256, quantization=quantization)
    return config.create_engine_config().model


def test_default_model_layers_map_onto_their_gguf_blocks(default_model_path):
    """Every fused layer (q/k/v with llama.cpp's q/k row permutation undone, gate/up) and the
    tied logits head compute with exactly the converted checkpoint's fp32 weights."""
    k = cpu_kernels.kernels()
    assert k is not None
    cfg = _default_model("gguf")
    assert cfg.hf_config["quantization_config"]["quant_method"] == "gguf"
    model = load_model(model_class(cfg.architecture), cfg.hf_config, cfg.path)
    CPUKernelOps(k).attach(model)
    ref = load_file(str(default_model_path / "model.safetensors"))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    assert len(layers) == 120 and all(m.packed is None for m in layers.values())
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for name, layer in layers.items():
        owner, leaf = name.rsplit(".", 1)
        parts = fused.get(leaf, (leaf,))
        w = torch.cat([ref[f"{owner}.{p}.weight"] for p in parts])
        assert layer.quantized.format == "q4_1"
        eye = torch.eye(layer.in_features)
        assert torch.equal(k.linear(eye, layer.quantized, None, layer.out_features), w.T), name
    weight, head = model.logits_head.quantized
    assert head.format == "q8_0" and weight is model.lm_head_weight
    emb = ref["model.embed_tokens.weight"]
    eye = torch.eye(emb.shape[1])
    assert torch.equal(model.compute_logits(eye), emb.T)


def test_quantization_engine_arg(tiny_llama_path, default_model_path):
    assert "quantization_config" not in _default_model("none").hf_config
    assert "quantization_config" not in _default_model(None).hf_config  # fp32 unless asked
    # No host path in the config: it fingerprints the model for KV transfers between hosts.
    assert _default_model("gguf").hf_config["quantization_config"] == {"quant_method": "gguf"}
    with pytest.raises(ValueError, match="quantization must be"):
        _default_model("awq")
    with pytest.raises(ValueError, match="runs on the CPU kernels of one process"):
        EngineArgs(
            model=DEFAULT, quantization="gguf", tensor_parallel_size=2
        ).create_engine_config()
    with pytest.raises(ValueError, match="needs a model converted from a .gguf"):
        EngineArgs(model=str(tiny_llama_path), quantization="gguf").create_engine_config()
    plain = EngineArgs(model=str(tiny_llama_path)).create_engine_config()
    assert "quantization_config" not in plain.model.hf_config


def test_engine_on_gguf_blocks_matches_transformers(k, default_model_path):
    """Greedy tokens on the Q4_1/Q8_0 kernels equal transformers' on the converted fp32
    checkpoint, on 1 and 2 threads."""
    llm = LLM(model=DEFAULT, max_model_len=256, num_threads=k.num_threads(), quantization="gguf")
    assert llm.engine.runner.model.logits_head.quantized[1].format == "q8_0"
    tok = llm.get_tokenizer()
    prompts = [
        tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]),
        tok.encode("1, 2, 3, 4, 5, 6, 7, 8,"),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    ref = hf_model(default_model_path)
    for ids, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, ids, 16)
