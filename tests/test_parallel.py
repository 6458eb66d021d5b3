"""Tensor parallelism: the head and vocabulary split, reading each rank's part of a checkpoint,
collectives and sharded models on two gloo ranks against one rank and transformers, and the
engine at tensor_parallel_size=2 against tensor_parallel_size=1 on the default model.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_FAMILIES, TINY_SETTINGS, make_tiny_model
from parallel_ranks import Job, as_tensor, run_group, sequence_logits
from safetensors import safe_open
from test_llama_vs_hf import hf_model

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.engine import LLMEngine
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.loader import iter_weights, load_hf_config, load_model
from neuron_runtime.models.registry import model_class
from neuron_runtime.parallel.collectives import Communicator
from neuron_runtime.parallel.layers import HeadShard, head_shard, split_evenly
from neuron_runtime.parallel.loading import checkpoint_slicer
from neuron_runtime.parallel.state import ParallelState, RankLayout, use_parallel_state

LOGIT_ATOL = 1e-4
TOKENS = [1, 504, 3458, 314, 4649, 28, 284, 260, 1589, 282, 260, 4197, 30, 378, 7, 1001]


def test_head_shard_splits_whole_gqa_groups():
    # kv heads divisible by the ranks
    assert head_shard(8, 4, 2, 1) == HeadShard(q_start=4, num_heads=4, kv_start=2, num_kv_heads=2)
    # not divisible (SmolLM2: 9 q / 3 kv heads): 2 + 1 kv heads with their 6 + 3 q heads
    assert head_shard(9, 3, 2, 0) == HeadShard(0, 6, 0, 2)
    assert head_shard(9, 3, 2, 1) == HeadShard(6, 3, 2, 1)
    # fewer kv heads than ranks: each kv head replicated, its q heads split
    assert [head_shard(8, 2, 4, r) for r in range(4)] == [
        HeadShard(0, 2, 0, 1),
        HeadShard(2, 2, 0, 1),
        HeadShard(4, 2, 1, 1),
        HeadShard(6, 2, 1, 1),
    ]
    with pytest.raises(ValueError, match="tensor_parallel_size 4 cannot split 6 attention heads"):
        head_shard(6, 2, 4, 0)


def test_split_evenly_and_rank_layout():
    assert [split_evenly(49155, 2, r) for r in range(2)] == [(0, 24578), (24578, 24577)]
    layout = RankLayout(tensor_parallel_size=2, data_parallel_size=2)
    assert layout.tp_groups() == [[0, 1], [2, 3]]
    assert layout.dp_groups() == [[0, 2], [1, 3]]
    assert (layout.tp_rank(3), layout.dp_rank(3)) == (1, 1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        ({"tensor_parallel_size": 4}, "tensor_parallel_size 4 cannot split 9 attention heads"),
        ({"enable_expert_parallel": True}, "enable_expert_parallel needs a mixture-of-experts"),
        ({"data_parallel_size": 2}, "data_parallel_size 2: an engine is one data-parallel rank"),
        ({"tensor_parallel_size": 2, "graph_mode": "inductor"}, "runs graph_mode 'eager' only"),
    ],
)
def test_parallel_settings_the_model_cannot_take_are_refused(overrides, message):
    args = EngineArgs(max_model_len=64, num_kv_blocks=8, **overrides)
    with pytest.raises(ValueError, match=message):
        args.create_engine_config()  # refused before anything loads or any rank starts


class _Rank1Of2(Communicator):
    """A TP group seen from rank 1 of 2, for building and loading a shard without peers."""

    rank, size = 1, 2


def test_each_rank_reads_only_its_part_of_the_checkpoint(tmp_path, default_model_path):
    settings = dict(TINY_SETTINGS, num_key_value_heads=2, attention_bias=True)
    path = make_tiny_model(tmp_path, default_model_path, "LlamaForCausalLM", settings, True)
    cfg = load_hf_config(path)
    with use_parallel_state(ParallelState(tp=_Rank1Of2())):
        model = model_class("LlamaForCausalLM")(cfg)
        slicer = checkpoint_slicer(model)
        assert slicer is not None
        read = dict(iter_weights(path, rank_slice=slicer))
        shard = load_model(model_class("LlamaForCausalLM"), cfg, path)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        full = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    hd = 16
    layer = "model.layers.0"
    # rank 1 holds q heads 2-3 and kv head 1, rows of q/k/v and columns of o_proj
    assert torch.equal(
        read[f"{layer}.self_attn.q_proj.weight"], full[f"{layer}.self_attn.q_proj.weight"][2 * hd :]
    )
    assert torch.equal(
        read[f"{layer}.self_attn.k_proj.bias"], full[f"{layer}.self_attn.k_proj.bias"][hd:]
    )
    assert torch.equal(
        read[f"{layer}.self_attn.o_proj.weight"],
        full[f"{layer}.self_attn.o_proj.weight"][:, 2 * hd :],
    )
    assert torch.equal(
        read[f"{layer}.mlp.down_proj.weight"], full[f"{layer}.mlp.down_proj.weight"][:, 64:]
    )
    assert torch.equal(read["model.embed_tokens.weight"], full["model.embed_tokens.weight"][24576:])
    assert torch.equal(read["lm_head.weight"], full["lm_head.weight"][24576:])
    assert torch.equal(read["model.norm.weight"], full["model.norm.weight"])  # replicated
    attn = shard.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    qkv = attn.qkv_proj.weight
    assert torch.equal(qkv[3 * hd :], full[f"{layer}.self_attn.v_proj.weight"][hd:])  # q, k, v
    # the o_proj bias is added once, by rank 0
    assert torch.count_nonzero(attn.o_proj.bias) == 0


@pytest.fixture(scope="module")
def dense_paths(tmp_path_factory, default_model_path) -> dict[str, str]:
    """Tiny random decoders whose heads split in every way two ranks meet."""
    families = {
        # 2 kv heads over 2 ranks; biases on q/k/v and o_proj (row-parallel bias)
        "llama-kv2": (
            "LlamaForCausalLM",
            dict(TINY_SETTINGS, num_key_value_heads=2, attention_bias=True),
        ),
        # 1 kv head (replicated on both ranks), tied embeddings, a vocabulary 2 does not divide
        "llama-kv1": (
            "LlamaForCausalLM",
            dict(TINY_SETTINGS, num_key_value_heads=1, tie_word_embeddings=True, vocab_size=49155),
        ),
        # 6 q / 3 kv heads: uneven split (2 kv heads, then 1); q/k/v biases
        "qwen2-kv3": (
            "Qwen2ForCausalLM",
            dict(TINY_SETTINGS, num_attention_heads=6, num_key_value_heads=3, head_dim=16),
        ),
        "gemma3": TINY_FAMILIES["gemma3"],
    }
    paths = {}
    for name, (arch, settings) in families.items():
        out = tmp_path_factory.mktemp(f"tp-{name}")
        paths[name] = str(make_tiny_model(out, default_model_path, arch, settings, True))
    return paths


def test_tp2_logits_match_one_rank_and_transformers(dense_paths):
    results = run_group([Job(name, path, TOKENS) for name, path in dense_paths.items()])
    assert all(results["collectives"].values()), results["collectives"]
    for name, path in dense_paths.items():
        cfg = load_hf_config(path)
        single = sequence_logits(
            load_model(model_class(cfg["architectures"][0]), cfg, path), TOKENS
        )
        with torch.inference_mode():
            expected = hf_model(path)(torch.tensor([TOKENS])).logits[0]
        got = as_tensor(results[name])
        torch.testing.assert_close(got, single, atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(got, expected, atol=LOGIT_ATOL, rtol=0)
        assert torch.equal(got.argmax(-1), single.argmax(-1)), name


def _generate(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outs = llm.generate(prompts, params)
    chat = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=12),
    )
    assert "Paris" in chat[0].outputs[0].text
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs] + [
        (chat[0].outputs[0].token_ids, [])
    ]


def _hand_off(prefill: LLMEngine, decode: LLMEngine, prompt: str, max_tokens: int) -> list[int]:
    """Prefill on one engine, KV copied out (every kv head) and continued on the other."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prefill.add_request("p", prompt, params, export_kv=True)
    first = None
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            first = out if out.finished else first
    assert first is not None and first.kv_handoff is not None
    handoff = first.kv_handoff
    handoff.kv = prefill.read_kv(handoff)
    assert prefill.release_kv(handoff.handoff_id)
    decode.add_request("d", prompt, params, handoff=handoff)
    final = None
    while decode.has_unfinished_requests():
        for out in decode.step():
            final = out if out.finished else final
    assert final is not None
    return list(final.outputs[0].token_ids)


def test_tp2_engine_greedy_identical_to_tp1_on_default_model():
    """Greedy tokens and logprobs of TP=2 against TP=1; KV handed off TP=2 -> TP=1 and back
    (the export gathers every rank's heads, the import takes each rank's own); then a dead
    rank."""
    kwargs = dict(max_model_len=256, num_kv_blocks=64, num_threads=1)
    llm = LLM("smollm2-135m-instruct", tensor_parallel_size=2, **kwargs)
    runner = llm.engine.runner
    single = LLM("smollm2-135m-instruct", **kwargs)  # built beside rank 0: unsharded
    try:
        sharded = _generate(llm)
        stats = llm.engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_unfinished_outputs) == (0, 0, 0)
        assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
        prompt = "Write a short poem about the sea. The sea"
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        expected = list(single.generate(prompt, params)[0].outputs[0].token_ids)
        assert _hand_off(llm.engine, single.engine, prompt, 12) == expected
        assert _hand_off(single.engine, llm.engine, prompt, 12) == expected
        runner.check_health()
        # a dead rank fails the health check, and the next step fails instead of waiting
        runner.workers[0].kill()
        runner.workers[0].join(timeout=10)
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] exited"):
            runner.check_health()
        with pytest.raises(RuntimeError):
            llm.generate("Hello", SamplingParams(max_tokens=2))
    finally:
        runner.close()
    reference = _generate(single)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(sharded, reference, strict=True):
        assert tokens == ref_tokens
        for got, want in zip(logprobs, ref_logprobs, strict=True):
            assert got.keys() == want.keys()
            assert max(abs(got[t] - want[t]) for t in want) < LOGIT_ATOL
