"""Shared fixtures: tiny random-weight checkpoints built with transformers, the default model."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from neuron_runtime.backends.cpu_kernels import CPUKernels

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


@pytest.fixture(scope="module", params=[1, 2], ids=["1thread", "2threads"])
def k(request: pytest.FixtureRequest) -> Iterator[CPUKernels]:
    """The CPU kernels on a pool of 1, then 2 threads: every test that takes it runs on both."""
    from neuron_runtime.backends.cpu_kernels import kernels

    fused = kernels()
    # This machine (and CI) has a C compiler: a missing build is a failure, not a skip.
    assert fused is not None, "the CPU kernels did not build"
    before = fused.num_threads()
    fused.set_num_threads(request.param)
    yield fused
    fused.set_num_threads(before)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from neuron_runtime.model_store import resolve_model

    return resolve_model("smollm2-135m-instruct")


# Shared by every tiny random decoder: the SmolLM2 vocabulary, 4 query heads.
TINY_SETTINGS = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.2,
)


def make_tiny_model(
    out: Path,
    tokenizer_src: Path,
    architecture: str,
    settings: dict,
    perturb_zero_init: bool = False,
) -> Path:
    """A seeded random transformers ``architecture`` model with the SmolLM2 tokenizer, saved as
    a normal HF folder (safetensors).

    ``perturb_zero_init`` adds noise to the biases and norm weights, which HF initializes to
    constants (zeros / ones), so that bias and norm-convention bugs change the outputs.
    """
    import transformers

    model_cls = getattr(transformers, architecture)
    torch.manual_seed(0)
    model = model_cls(model_cls.config_class(**settings)).float().eval()
    if perturb_zero_init:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_src / name).exists() and not (out / name).exists():
            shutil.copy(tokenizer_src / name, out / name)
    return out


def make_tiny_llama(out: Path, tokenizer_src: Path, **overrides) -> Path:
    """A random LlamaForCausalLM with the SmolLM2 tokenizer, saved as a normal HF folder.

    The weights are drawn wider than HF's default init so that logits have clear margins:
    greedy comparisons then test the maths, not fp32 rounding between near-equal tokens.
    """
    settings = dict(TINY_SETTINGS, num_key_value_heads=2, tie_word_embeddings=False)
    settings.update(overrides)
    return make_tiny_model(out, tokenizer_src, "LlamaForCausalLM", settings)


@pytest.fixture(scope="session")
def tiny_llava_path(default_model_path) -> Path:
    """The tiny random LLaVA (configs/build_tiny_llava.py), built once into the model cache."""
    from neuron_runtime.model_store import resolve_model

    return resolve_model("tiny-llava")


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


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus text exposition's samples of ``name`` over all label sets."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def busy_engines(stats: list[dict]) -> list[dict]:
    """The engine replicas' stats snapshots that still show work or hold KV."""
    return [
        s
        for s in stats
        if s["num_running"]
        or s["num_waiting"]
        or s["num_unfinished_outputs"]
        or s["num_kv_blocks_used"]
        or s.get("num_kv_outbox")
    ]


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
        # Declared only: Ray pins actors that ask for it (NEURON_RT_VISIBLE_CORES), no hardware.
        resources={"neuron_cores": 4},
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def fuzz_app(serve_cluster, tiny_llava_path):
    """The disaggregated app as app "fuzz" (its base URL): encode -> prefill -> decode on the
    tiny LLaVA served as "tiny", plus the embedding model, one replica each, deployed through
    the config path. A 256-token context and a 64-block KV cache, so hostile requests reach
    their limits fast."""
    from chaos.harness import deploy
    from ray import serve

    args = {
        "mode": "disaggregated",
        "model": str(tiny_llava_path),
        "served_model_name": "tiny",
        "max_model_len": 256,
        "embedding_model": "all-minilm-l6-v2",
        "max_body_bytes": 4 << 20,
        "engine_args": {"num_kv_blocks": 64},
        "multimodal": {"encoder": "separate"},
    }
    names = ("OpenAIIngress", "PDRouter", "VisionEncoder", "PrefillServer", "DecodeServer")
    deployments = [
        {"name": name, "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.05}}
        for name in (*names, "EmbeddingServer")
    ]
    deploy("fuzz", "/fuzz", args, deployments, int(serve_cluster.rsplit(":", 1)[1]))
    try:
        yield f"{serve_cluster}/fuzz"
    finally:
        serve.delete("fuzz")


# Tiny random configs of the other families; each sets what makes that family differ.
TINY_FAMILIES = {
    "qwen2": (
        "Qwen2ForCausalLM",
        dict(TINY_SETTINGS, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        # Layer 1 slides (window 8), layer 0 is global; head_dim != hidden / heads.
        dict(
            TINY_SETTINGS,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        ),
    ),
    "mistral": (
        "MistralForCausalLM",
        dict(TINY_SETTINGS, num_key_value_heads=1, sliding_window=8, tie_word_embeddings=False),
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        dict(
            TINY_SETTINGS,
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=8,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            pad_token_id=0,
        ),
    ),
}


@pytest.fixture(scope="session", params=sorted(TINY_FAMILIES))
def tiny_family_path(request, tmp_path_factory, default_model_path) -> Path:
    """One tiny random checkpoint per family in TINY_FAMILIES (norms and biases perturbed)."""
    architecture, settings = TINY_FAMILIES[request.param]
    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return make_tiny_model(out, default_model_path, architecture, settings, perturb_zero_init=True)
