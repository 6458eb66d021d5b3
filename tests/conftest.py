"""Shared fixtures: tiny random-weight checkpoints built with transformers, the default model."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

# Ray reads this when it is imported (test modules import it at collection): it makes every
# Ray listener bind to 127.0.0.1.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(int(os.environ.get("NEURON_SERVE_TEST_THREADS", "2")))

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from neuron_runtime.model_store import resolve_model

    return resolve_model("smollm2-135m-instruct")


def make_tiny_llama(out: Path, tokenizer_src: Path, **overrides) -> Path:
    """A random LlamaForCausalLM with the SmolLM2 tokenizer, saved as a normal HF folder.

    The weights are drawn wider than HF's default init so that logits have clear margins:
    greedy comparisons then test the maths, not fp32 rounding between near-equal tokens.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**settings)).float().eval()
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_src / name).exists() and not (out / name).exists():
            shutil.copy(tokenizer_src / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, default_model_path) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_path)


@pytest.fixture(scope="session")
def tiny_llama3_tied_path(tmp_path_factory, default_model_path) -> Path:
    """Tied embeddings and Llama 3.1 rope scaling."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama3"),
        default_model_path,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def serve_cluster():
    """One local Ray cluster and Serve instance for every Serve test module; the base URL.

    Everything listens on 127.0.0.1. Logical CPUs are more than the machine's two so that
    several small test applications fit; their replicas mostly wait.
    """
    ray = pytest.importorskip("ray")
    from ray import serve

    port = _free_port()
    ray.init(
        address="local",
        include_dashboard=False,
        num_cpus=4,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
