"""The command line and the model registry's errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.backends import cpu_kernels


@pytest.mark.parametrize(
    "dtype,kv_cache_dtype",
    [("float32", "auto"), ("bfloat16", "auto"), ("float32", "bfloat16"), ("bfloat16", "float32")],
)
def test_cli_generate_prints_the_offline_greedy_text(tiny_llama_path, dtype, kv_cache_dtype):
    fused = cpu_kernels.kernels()
    if dtype == "bfloat16" and (fused is None or not fused.has_bf16):
        pytest.skip("this CPU has no AVX512_BF16")
    prompt = "Once upon a time"
    llm = LLM(
        model=str(tiny_llama_path),
        max_model_len=256,
        num_kv_blocks=32,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
    )
    expected = (
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "neuron_runtime.cli",
            "generate",
            "--model",
            str(tiny_llama_path),
            "--max-model-len",
            "256",
            "--prompt",
            prompt,
            "--max-tokens",
            "8",
            "--dtype",
            dtype,
            "--kv-cache-dtype",
            kv_cache_dtype,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert proc.stdout == expected + "\n"


def test_cli_chat_streams_replies_until_eof(tiny_llama_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "neuron_runtime.cli",
            "chat",
            "--model",
            str(tiny_llama_path),
            "--max-model-len",
            "256",
            "--max-tokens",
            "4",
        ],
        input="hello\nand again\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert proc.stdout.count("> ") == 3  # two turns answered, then the prompt that met EOF


def test_cli_reports_bad_arguments_without_a_traceback(tiny_llama_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "neuron_runtime.cli",
            "generate",
            "--model",
            str(tiny_llama_path),
            "--max-model-len",
            "256",
            "--prompt",
            "hi",
            "--temperature",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "temperature" in proc.stderr and "Traceback" not in proc.stderr


def test_unsupported_architecture_is_named(tmp_path, tiny_llama_path):
    for item in tiny_llama_path.iterdir():
        (tmp_path / item.name).symlink_to(item)
    config = json.loads((tiny_llama_path / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FancyNewForCausalLM"):
        LLM(model=str(tmp_path), max_model_len=256)


def test_unknown_model_string_is_rejected():
    with pytest.raises(ValueError, match="no-such-model"):
        LLM(model="no-such-model")
