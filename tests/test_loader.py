"""loader: config and safetensors reading, checked against transformers' own state dict."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_runtime.loader import iter_weights, load_hf_config, load_model


def _tiny_llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(dtype)


@pytest.mark.parametrize("max_shard_size", ["20KB", "50GB"])
def test_iter_weights_yields_the_state_dict(tmp_path: Path, max_shard_size: str) -> None:
    model = _tiny_llama()
    model.save_pretrained(tmp_path, max_shard_size=max_shard_size)
    sharded = (tmp_path / "model.safetensors.index.json").is_file()
    assert sharded == (max_shard_size == "20KB")

    weights = dict(iter_weights(tmp_path))
    expected = model.state_dict()
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], tensor), name


def test_half_precision_weights_become_float32(tmp_path: Path) -> None:
    model = _tiny_llama(torch.bfloat16)
    model.save_pretrained(tmp_path)
    for name, tensor in iter_weights(tmp_path):
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, model.state_dict()[name].float()), name


def test_loose_safetensors_files(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2)}, tmp_path / "part-b.safetensors")
    save_file({"b": torch.zeros(3, dtype=torch.float16)}, tmp_path / "part-a.safetensors")
    weights = dict(iter_weights(tmp_path))
    assert list(weights) == ["b", "a"]
    assert weights["b"].dtype == torch.float32


def test_folder_without_weights(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights"):
        list(iter_weights(tmp_path))


def test_load_hf_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json is missing"):
        load_hf_config(tmp_path)
    _tiny_llama().save_pretrained(tmp_path)
    config = load_hf_config(tmp_path)
    assert config["num_hidden_layers"] == 2 and config["architectures"] == ["LlamaForCausalLM"]


class _Recorder(torch.nn.Module):
    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.loaded = dict(weights)


def test_load_model(tmp_path: Path) -> None:
    model = _tiny_llama()
    model.save_pretrained(tmp_path)
    config = load_hf_config(tmp_path)
    loaded = load_model(_Recorder, config, tmp_path)
    assert not loaded.training
    assert loaded.hf_config is config
    assert loaded.loaded.keys() == model.state_dict().keys()
