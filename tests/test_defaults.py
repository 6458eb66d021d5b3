"""Defaults that work: ``LLM(model=folder)`` with nothing else on a model whose context (32k
positions) needs more KV than the old fixed 512 MiB budget held.

The model is a tiny random Qwen2 with Qwen2.5-0.5B's KV geometry (24 layers, 2 KV heads of 64):
24 KiB of KV per token, 768 MiB for its 32,768 positions.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from conftest import TINY_SETTINGS, make_tiny_model

from app.builder import BuildArgs, validate_args
from neuron_runtime import cli, engine_args, kv_budget
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.kv_budget import (
    DEFAULT_KV_CACHE_BYTES,
    kv_capacity_tokens,
    plan_kv_cache,
    weight_bytes,
)
from neuron_runtime.llm import LLM
from neuron_runtime.sampling_params import SamplingParams

CONTEXT = 32768
BYTES_PER_TOKEN = 2 * 24 * 2 * 64 * 4
MiB = 1 << 20
GiB = 1 << 30
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def long_context_path(tmp_path_factory, default_model_path):
    settings = dict(
        TINY_SETTINGS,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=24,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,
    )
    return make_tiny_model(
        tmp_path_factory.mktemp("qwen2-32k"), default_model_path, "Qwen2ForCausalLM", settings
    )


def memory(monkeypatch, available: int | None) -> None:
    """Fixes what the host reports as available, so the budget does not depend on the box."""
    monkeypatch.setattr(engine_args, "available_memory_bytes", lambda: available)


def hf_greedy(path, prompt_ids: list[int], n: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt_ids) :].tolist()


def greedy(llm: LLM, n: int) -> tuple[list[int], list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0]
    return list(out.prompt_token_ids), list(out.outputs[0].token_ids)


def test_llm_with_no_args_holds_the_models_context_and_generates(
    monkeypatch, caplog, long_context_path
):
    memory(monkeypatch, 16 * GiB)
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=str(long_context_path))
    config = llm.engine.config
    assert config.model.max_model_len == CONTEXT
    # Sized for one full-length sequence: 768 MiB, over the 512 MiB floor.
    assert config.cache.kv_cache_bytes == CONTEXT * BYTES_PER_TOKEN > DEFAULT_KV_CACHE_BYTES
    assert llm.engine.runner.num_blocks * config.cache.block_size == CONTEXT
    assert not [r for r in caplog.records if "max_model_len capped" in r.getMessage()]
    prompt_ids, tokens = greedy(llm, 8)
    assert tokens == hf_greedy(long_context_path, prompt_ids, 8)


def test_short_memory_caps_max_model_len_with_one_warning(monkeypatch, caplog, long_context_path):
    # The weights plus 512 MiB free: half of 512 MiB for the KV, 682 blocks of 16 tokens.
    memory(monkeypatch, weight_bytes(long_context_path) + 512 * MiB)
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=str(long_context_path))
    capped = (256 * MiB // (16 * BYTES_PER_TOKEN)) * 16
    assert llm.engine.config.model.max_model_len == capped == 10912
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"max_model_len capped to {capped} tokens (the model allows")
    assert "kv_cache_memory_fraction 0.5" in warnings[0]
    prompt_ids, tokens = greedy(llm, 4)
    assert tokens == hf_greedy(long_context_path, prompt_ids, 4)


def test_a_max_model_len_asked_for_is_never_capped(monkeypatch, long_context_path):
    memory(monkeypatch, weight_bytes(long_context_path) + 512 * MiB)
    config = EngineArgs(model=str(long_context_path), max_model_len=CONTEXT).create_engine_config()
    assert config.model.max_model_len == CONTEXT
    assert kv_capacity_tokens(config) == 10912  # the engine refuses this config
    with pytest.raises(ValueError, match=r"fewer than max_model_len \(32768\)"):
        LLM(model=str(long_context_path), max_model_len=CONTEXT)


def test_serve_config_checks_with_the_same_budget(monkeypatch, long_context_path):
    memory(monkeypatch, 16 * GiB)
    build = BuildArgs(model=str(long_context_path), max_model_len=CONTEXT, embedding_model=None)
    config = validate_args(build)
    assert config.cache.kv_cache_bytes == CONTEXT * BYTES_PER_TOKEN
    assert config == EngineArgs(**build.full_engine_args()).create_engine_config()
    memory(monkeypatch, weight_bytes(long_context_path) + 512 * MiB)
    with pytest.raises(ValueError, match=r"KV cache's 10912 tokens \(the default budget of "):
        validate_args(build)
    fixed = BuildArgs(
        model=str(long_context_path),
        max_model_len=CONTEXT,
        embedding_model=None,
        engine_args={"kv_cache_memory_bytes": 512 * MiB},
    )
    with pytest.raises(ValueError, match=r"engine_args.kv_cache_memory_bytes 536870912,"):
        validate_args(fixed)


def test_cli_uses_the_same_defaults(monkeypatch, caplog, capsys, long_context_path):
    memory(monkeypatch, weight_bytes(long_context_path) + 512 * MiB)
    argv = ["generate", "--model", str(long_context_path), "--prompt", PROMPT, "--max-tokens", "3"]
    with caplog.at_level(logging.WARNING):
        cli.main(argv)
    assert [r.getMessage()[:33] for r in caplog.records] == ["max_model_len capped to 10912 tok"]
    assert capsys.readouterr().out.strip()


# -- the plan as a pure function ------------------------------------------------------------


def plan(**overrides):
    settings = dict(
        bytes_per_token=BYTES_PER_TOKEN,
        block_size=16,
        model_limit=CONTEXT,
        max_model_len=None,
        kv_cache_bytes=None,
        num_blocks=None,
        memory_fraction=0.5,
        available_bytes=16 * GiB,
        weight_bytes=2 * GiB,
    )
    return plan_kv_cache(**{**settings, **overrides})


def test_plan_default_budget_floor_and_bound(caplog):
    # A short context keeps the 512 MiB floor (the old fixed default).
    assert plan(model_limit=2048).kv_cache_bytes == DEFAULT_KV_CACHE_BYTES
    # A long one gets one full-length sequence.
    assert plan().kv_cache_bytes == CONTEXT * BYTES_PER_TOKEN
    assert plan().max_model_len == CONTEXT
    # Bounded by the fraction of what is left after the weights.
    bounded = plan(available_bytes=2 * GiB + 600 * MiB)
    assert bounded.kv_cache_bytes == 300 * MiB
    assert bounded.max_model_len == (300 * MiB // (16 * BYTES_PER_TOKEN)) * 16
    # Unknown memory: no bound.
    assert plan(available_bytes=None).kv_cache_bytes == CONTEXT * BYTES_PER_TOKEN


def test_plan_configured_budget_caps_only_a_derived_length(caplog):
    with caplog.at_level(logging.WARNING):
        fixed = plan(kv_cache_bytes=512 * MiB)
    assert fixed.kv_cache_bytes == 512 * MiB
    assert fixed.max_model_len == 21840  # 1365 blocks of 16
    assert "(kv_cache_memory_bytes 536870912)" in caplog.records[-1].getMessage()
    assert plan(num_blocks=100).max_model_len == 1600
    assert plan(kv_cache_bytes=512 * MiB, max_model_len=CONTEXT).max_model_len == CONTEXT
    assert plan(num_blocks=100, max_model_len=4096).max_model_len == 4096


def test_engine_args_refuse_a_bad_fraction(long_context_path):
    for fraction in (0.0, 1.5):
        with pytest.raises(ValueError, match="kv_cache_memory_fraction must be in"):
            EngineArgs(
                model=str(long_context_path), kv_cache_memory_fraction=fraction
            ).create_engine_config()


def test_available_memory_is_read_from_the_host():
    available = kv_budget.available_memory_bytes()
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert available is not None and 0 < available <= total


# -- progress of one-time steps -------------------------------------------------------------


def test_gguf_conversion_says_what_it_does_on_stderr_once(monkeypatch, capsys, tmp_path):
    from neuron_runtime import model_store

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" * 1000)
    monkeypatch.setenv("NEURON_SERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(
        model_store, "convert_gguf_to_hf", lambda g, o: (o / "config.json").write_text("{}")
    )
    folder = model_store.resolve_model(str(gguf))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (
        f"neuron-serve: converting tiny.gguf (0 MB) into {folder} (once; later starts reuse it) ..."
    )
    assert re.fullmatch(r"neuron-serve: done in \d+\.\d s", lines[1]) and len(lines) == 2
    assert model_store.resolve_model(str(gguf)) == folder
    assert capsys.readouterr().err == ""
