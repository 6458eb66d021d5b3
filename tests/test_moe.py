"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers' own classes, and their
split over two gloo ranks: experts sliced (TP=2) and experts spread (EP=2, all-to-all).

Tiny random configs built with transformers (tests/conftest.py ``make_tiny_model``): 8 experts,
top-2, Qwen3-MoE without renormalization and with one dense layer, Mixtral (always
renormalized) with a single kv head (replicated over the two ranks).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_SETTINGS, make_tiny_model
from parallel_ranks import Job, as_tensor, run_group, sequence_logits
from test_llama_vs_hf import hf_greedy, hf_model

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.layers.moe import route
from neuron_runtime.loader import load_hf_config, load_model
from neuron_runtime.models.registry import model_class

LOGIT_ATOL = 1e-4
TOKENS = [1, 504, 3458, 314, 4649, 28, 284, 260, 1589, 282, 260, 4197, 30, 378, 7, 1001]

MOE_FAMILIES = {
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        dict(
            TINY_SETTINGS,
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "mixtral": (
        "MixtralForCausalLM",
        dict(
            TINY_SETTINGS,
            num_key_value_heads=1,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=48,
            tie_word_embeddings=False,
        ),
    ),
}


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory, default_model_path) -> dict[str, str]:
    paths = {}
    for name, (arch, settings) in MOE_FAMILIES.items():
        out = tmp_path_factory.mktemp(f"tiny-{name}")
        paths[name] = str(
            make_tiny_model(out, default_model_path, arch, settings, perturb_zero_init=True)
        )
    return paths


def test_route_softmax_topk_and_renormalization():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    probs = torch.softmax(logits, dim=-1)[0]
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 2]]
    torch.testing.assert_close(weights[0], probs[[0, 2]])
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights[0], probs[[0, 2]] / probs[[0, 2]].sum())


def test_moe_models_are_registered():
    for arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        assert model_class(arch).__name__ == arch


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_moe_logits_and_greedy_match_transformers(family, moe_paths):
    path = moe_paths[family]
    ref = hf_model(path)
    cfg = load_hf_config(path)
    ours = load_model(model_class(cfg["architectures"][0]), cfg, path)
    with torch.inference_mode():
        expected = ref(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(sequence_logits(ours, TOKENS), expected, atol=LOGIT_ATOL, rtol=0)
    llm = LLM(model=path, max_model_len=128, num_kv_blocks=64, num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": TOKENS}], params)[0]
    assert out.outputs[0].token_ids == hf_greedy(ref, TOKENS, 12)


def test_moe_tensor_and_expert_parallel_match_one_rank(moe_paths):
    """TP=2 (every expert sliced) and EP=2 (experts spread, all-to-all) against one rank."""
    jobs = [
        Job(f"{name}-{mode}", path, TOKENS, expert_parallel=mode == "ep")
        for name, path in moe_paths.items()
        for mode in ("tp", "ep")
    ]
    results = run_group(jobs)
    assert all(results["collectives"].values()), results["collectives"]
    for name, path in moe_paths.items():
        cfg = load_hf_config(path)
        single = sequence_logits(
            load_model(model_class(cfg["architectures"][0]), cfg, path), TOKENS
        )
        for mode in ("tp", "ep"):
            got = as_tensor(results[f"{name}-{mode}"])
            torch.testing.assert_close(got, single, atol=LOGIT_ATOL, rtol=0)
            assert torch.equal(got.argmax(-1), single.argmax(-1)), (name, mode)
