"""The static runner (graph_mode: inductor) against the eager engine on the same weights.

Each engine compiles its buckets at start with ``on_recompile="error"``, so any compile after
warm-up fails the step that caused it; the workloads below vary batch sizes, prompt lengths,
chunking, prefix hits, preemption and sampling settings, and the compile count is asserted
to stay where warm-up left it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_FAMILIES, make_tiny_llama, make_tiny_model

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.backends.static.buckets import Buckets, powers_of_two
from neuron_runtime.backends.static.ops import StaticAttentionMetadata

# Small limits keep the warm-up short: 8 model graphs and 6 sampler graphs per engine.
ENGINE = dict(
    max_model_len=128,
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=32,  # prompts longer than this are prefilled in chunks
    num_kv_blocks=40,  # 160 tokens for 8 sequences of up to 56: preemption
)
STATIC = dict(
    graph_mode="inductor",
    compile_scope="step",  # one graph per bucket for the whole step
    seq_buckets=[2, 8],
    token_buckets=[16, 32],
    context_buckets=[8, 32],
    on_recompile="error",
)

# Mixed lengths; the last two share the first two's prompts (prefix-cache hits).
PROMPT_LENS = (3, 40, 11, 27, 6, 33)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    out = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return out + [out[1] + [7, 8, 9], out[3][:20]]


def generate(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params)
    return [o.outputs[0].token_ids for o in outs]


def compiles_after_warm_up(llm: LLM) -> int:
    static = llm.engine.runner.static
    assert static is not None
    return static.num_compiles_after_warm_up


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def model_pair(request, tmp_path_factory, default_model_path):
    """(eager LLM, inductor LLM) on one tiny random checkpoint of each family."""
    out = tmp_path_factory.mktemp(f"static-{request.param}")
    if request.param == "llama":
        path = make_tiny_llama(out, default_model_path)
    else:
        architecture, settings = TINY_FAMILIES[request.param]
        path = make_tiny_model(out, default_model_path, architecture, settings, True)
    eager = LLM(model=str(path), **ENGINE)
    static = LLM(model=str(path), **ENGINE, **STATIC)
    return eager, static


def test_greedy_tokens_equal_the_eager_path(model_pair):
    eager, static = model_pair
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = generate(eager, params)
    assert generate(static, params) == expected
    # The KV budget forced preemptions, and the repeated prefixes hit the cache, on both.
    for llm in (eager, static):
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.kv.prefix_cache_hits > 0
    assert compiles_after_warm_up(static) == 0


def test_seeded_sampling_equals_the_eager_path(model_pair):
    eager, static = model_pair
    settings = [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=20),
        dict(temperature=1.2, top_p=0.8),
        dict(temperature=1.0, min_p=0.05, presence_penalty=0.5),
        dict(temperature=0.0, repetition_penalty=1.3),
        dict(temperature=0.9, frequency_penalty=0.4, top_k=50, top_p=0.9),
        dict(temperature=1.0, logit_bias={42: 5.0, 43: -100.0}),
        dict(temperature=0.8, min_tokens=4),
    ]
    params = [
        SamplingParams(max_tokens=10, seed=100 + i, ignore_eos=True, **s)
        for i, s in enumerate(settings)
    ]
    assert generate(static, params) == generate(eager, params)
    assert compiles_after_warm_up(static) == 0


def test_varied_workload_compiles_nothing_after_warm_up(model_pair):
    _, static = model_pair
    for batch in (1, 2, 5, 8, 3):
        params = SamplingParams(temperature=0.5 * (batch % 3), max_tokens=3 + batch, seed=batch)
        static.generate([{"prompt_token_ids": p} for p in prompts()[:batch]], params)
    assert compiles_after_warm_up(static) == 0
    assert not static.engine.has_unfinished_requests()
    assert static.engine.kv.pool.num_used_blocks == 0


def test_default_model_greedy_equals_eager(default_model_path):
    """SmolLM2 (30 layers) with one bucket per dimension, a chat batch of mixed lengths."""
    limits = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    eager = LLM(model=str(default_model_path), **limits)
    static = LLM(
        model=str(default_model_path),
        **limits,
        graph_mode="inductor",
        compile_scope="layer",  # the 30 layers share one compiled graph per bucket
        seq_buckets=[4],
        token_buckets=[64],
        context_buckets=[16],
        on_recompile="error",
    )
    chats = [
        [{"role": "user", "content": q}]
        for q in ("What is the capital of France?", "Name three colors.", "Count to five.")
    ]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    expected = [o.outputs[0].token_ids for o in eager.chat(chats, params)]
    got = [o.outputs[0].token_ids for o in static.chat(chats, params)]
    assert got == expected
    assert "Paris" in static.get_tokenizer().decode(got[0])
    assert compiles_after_warm_up(static) == 0


def test_padding_leaves_real_rows_and_other_blocks_alone(model_pair):
    """One real decode row run in a bucket of 2 and of 8: the same hidden state and logits,
    and the padding rows write nothing but the null block."""
    eager, static_llm = model_pair
    runner = static_llm.engine.runner
    static = runner.static
    assert static is not None
    torch.manual_seed(0)
    for k_cache, v_cache in runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    table = [3, 9, 4]
    results = []
    for num_seqs in (1, 8):
        bucket = static.buckets.decode(num_seqs, 3)
        with torch.no_grad():  # as steps run (grad mode is part of the graphs' guards)
            inputs = static._rows(bucket, [[77]], [[10]], [table], None)
            hidden, logits, _ = static._run_model(bucket, inputs)
        results.append((hidden[0], logits[0]))
        # Only the real token's slot (position 10: block 4, offset 2) and the null block.
        for (k_before, v_before), (k_after, v_after) in zip(before, runner.kv_caches, strict=True):
            for old, new in ((k_before, k_after), (v_before, v_after)):
                changed = (old != new).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
                assert set(changed) <= {4, static.null_block}
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-5)
    assert static.buckets.decode(1, 3).num_seqs == 2  # the smallest bucket really padded


def test_static_attention_equals_a_dense_reference():
    """Two rows of a prefill grid against plain causal softmax attention over their keys."""
    from neuron_runtime.backends.static.ops import STATIC_OPS

    torch.manual_seed(1)
    kvh, heads, d, bs, num_blocks = 2, 4, 8, 4, 16
    k_cache, v_cache = torch.randn(kvh, num_blocks, bs, d), torch.randn(kvh, num_blocks, bs, d)
    tables = torch.tensor([[5, 6, 15], [2, 15, 15]])  # row 1 has one block; 15 is padding
    starts, lens, q_len = [5, 0], [3, 2], 4
    positions = torch.zeros(2, q_len, dtype=torch.long)
    slots = torch.full((2, q_len), 15 * bs)
    for s in range(2):
        for i in range(lens[s]):
            p = starts[s] + i
            positions[s, i] = p
            slots[s, i] = tables[s, p // bs] * bs + p % bs
    q = torch.randn(2 * q_len, heads, d)
    k, v = torch.randn(2 * q_len, kvh, d), torch.randn(2 * q_len, kvh, d)
    meta = StaticAttentionMetadata(slots.flatten(), positions, tables, 2, q_len)
    out = STATIC_OPS.attention(q, k, v, k_cache, v_cache, meta, d**-0.5, None, None)
    out = out.view(2, q_len, heads, d)
    for s in range(2):
        ctx = starts[s] + lens[s]
        flat = torch.tensor([int(tables[s, j // bs]) * bs + j % bs for j in range(ctx)])
        keys = k_cache.view(kvh, -1, d)[:, flat]  # written by the call: [kvh, ctx, d]
        values = v_cache.view(kvh, -1, d)[:, flat]
        for i in range(lens[s]):
            qi = q.view(2, q_len, heads, d)[s, i].view(kvh, heads // kvh, d)
            visible = starts[s] + i + 1
            scores = qi @ keys[:, :visible].transpose(1, 2) * d**-0.5
            ref = (scores.softmax(-1) @ values[:, :visible]).reshape(heads, d)
            torch.testing.assert_close(out[s, i], ref, rtol=1e-5, atol=1e-5)


def test_buckets_cover_every_selectable_shape():
    assert powers_of_two(64) == (1, 2, 4, 8, 16, 32, 64)
    assert powers_of_two(48, 16) == (16, 32, 48)
    buckets = Buckets(seqs=(1, 4), tokens=(16, 64), context_blocks=(4, 16), block_size=4)
    warm = set(buckets.all())
    for n in range(1, 5):
        for ctx in range(1, 17):
            assert buckets.decode(n, ctx) in warm
    for tokens in range(1, 65):
        for ctx in range(1, 17):
            if -(-tokens // 4) <= ctx:
                assert buckets.prefill(tokens, ctx) in warm
    with pytest.raises(ValueError, match="no bucket"):
        buckets.decode(5, 1)


def test_bucket_lists_must_reach_the_limits(tiny_llama_path: Path):
    with pytest.raises(ValueError, match="seq_buckets end at 4"):
        LLM(model=str(tiny_llama_path), **{**ENGINE, **STATIC, "seq_buckets": [2, 4]})
    with pytest.raises(ValueError, match="increasing"):
        LLM(model=str(tiny_llama_path), **{**ENGINE, **STATIC, "seq_buckets": [8, 2]})
    with pytest.raises(ValueError, match="graph_mode"):
        LLM(model=str(tiny_llama_path), **{**ENGINE, "graph_mode": "cuda-graphs"})
    with pytest.raises(ValueError, match="runs graph_mode eager, inductor, not 'lazy'"):
        LLM(model=str(tiny_llama_path), **{**ENGINE, "graph_mode": "lazy"})
