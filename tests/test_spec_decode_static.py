"""N-gram speculation on the static runner (graph_mode inductor): verify slices run as
``[num_seqs, k + 1]`` grids compiled at start; greedy tokens equal the eager engine's without
speculation, and no graph is compiled after warm-up."""

from __future__ import annotations

import pytest
from conftest import make_tiny_llama

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.backends.static.buckets import Buckets

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
# One bucket per dimension keeps warm-up short: decode, verify and prefill graphs, and the
# sampler graphs of 1 and 4 rows.
ENGINE = dict(
    max_model_len=128,
    block_size=8,
    max_num_seqs=4,
    max_num_batched_tokens=32,  # longer prompts are prefilled in chunks
    num_kv_blocks=24,  # 192 tokens for 4 sequences of up to ~70: preemption
)
STATIC = dict(
    graph_mode="inductor",
    compile_scope="step",
    seq_buckets=[4],
    token_buckets=[32],
    context_buckets=[16],
    on_recompile="error",
)
# Repetitive prompts (the n-gram proposer finds matches), mixed lengths, one of 3 tokens.
PROMPTS = [
    [11, 12, 13, 14, 15, 16, 17, 18] * 4 + [11, 12, 13],
    [21, 22, 23, 24] * 6 + list(range(500, 512)) + [21, 22],
    [7, 8, 9],
    list(range(300, 340)),
]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(llm: LLM, prompts: list, params: SamplingParams | list[SamplingParams]) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def expected_graphs(buckets: Buckets) -> int:
    """Model graphs: (decode + verify) x seq x context buckets + prefill buckets; sampler
    graphs: three kinds x the row counts they run at (1 and each seq bucket)."""
    sampler_sizes = {1, *buckets.seqs}
    return len(buckets.all()) + 3 * len(sampler_sizes)


def check_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == stats.num_kv_blocks_used == 0
    assert stats.num_unfinished_outputs == 0


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, default_model_path):
    return make_tiny_llama(tmp_path_factory.mktemp("static-spec"), default_model_path)


def test_tiny_model_greedy_equals_eager_without_speculation(tiny_path):
    """Chunked prefill, preemption, a mixed batch (one request with a presence penalty, which
    does not speculate) and short prompts in the verify grid."""
    eager = LLM(model=str(tiny_path), **ENGINE)
    static = LLM(model=str(tiny_path), **ENGINE, **STATIC, speculative_config=NGRAM)
    params = [greedy(40)] * len(PROMPTS)
    params[3] = SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, presence_penalty=0.5
    )
    expected = token_ids(eager, PROMPTS, params)
    assert token_ids(static, PROMPTS, params) == expected
    stats = static.engine.stats()
    assert stats.spec_decode is not None
    assert stats.spec_decode.num_drafts > 0 and stats.spec_decode.num_accepted_tokens > 0
    assert stats.num_preemptions > 0
    runner = static.engine.runner.static
    assert runner is not None
    warm = len(runner.buckets.all())
    assert runner.phase_runs["verify"] > 1  # warm-up ran it once; the steps did again
    # Bounded: exactly the warm-up's graphs, none compiled since.
    assert runner.compiler.num_compiles == expected_graphs(runner.buckets)
    assert runner.num_compiles_after_warm_up == 0
    assert [b.phase for b in runner.buckets.all()].count("verify") == 1
    assert warm == 3
    check_idle(static)


def test_default_model_greedy_equals_eager_without_speculation(default_model_path):
    """SmolLM2 on repetitive chats, one at a time (the decoder layer compiled per bucket; one
    sequence bucket keeps warm-up short)."""
    limits = dict(max_model_len=256, max_num_seqs=1, max_num_batched_tokens=64)
    chats = [
        [{"role": "user", "content": q}]
        for q in (
            "Repeat this line three times: the quick brown fox jumps over the lazy dog.",
            "What is the capital of France?",
        )
    ]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    eager = LLM(model=str(default_model_path), **limits)
    expected = [o.outputs[0].token_ids for o in eager.chat(chats, params)]
    static = LLM(
        model=str(default_model_path),
        **limits,
        graph_mode="inductor",
        compile_scope="layer",
        seq_buckets=[1],
        token_buckets=[64],
        context_buckets=[16],
        on_recompile="error",
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    outs = static.chat(chats, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert "Paris" in outs[1].outputs[0].text
    assert static.engine.stats().spec_decode.num_accepted_tokens > 0
    runner = static.engine.runner.static
    assert runner.phase_runs["verify"] > 1
    # Compiled per layer: each bucket's first layer (no residual input yet) is a graph of
    # its own, so 2 x 3 model graphs and 3 sampler graphs, all at warm-up.
    assert runner.compiler.num_compiles == expected_graphs(runner.buckets) + 3 == 9
    assert runner.num_compiles_after_warm_up == 0
    check_idle(static)


def test_buckets_hold_every_short_slice_grid():
    buckets = Buckets(
        seqs=(1, 4), tokens=(16, 64), context_blocks=(4, 16), block_size=4, verify_tokens=4
    )
    warm = set(buckets.all())
    for n in range(1, 5):
        for ctx in range(1, 17):
            for widest in range(1, 5):
                bucket = buckets.rows(n, widest, ctx)
                assert bucket in warm
                assert bucket.num_tokens == (1 if widest == 1 else 4)
    # Without speculation there are no verify grids.
    plain = Buckets(seqs=(1, 4), tokens=(16, 64), context_blocks=(4, 16), block_size=4)
    assert all(b.phase != "verify" for b in plain.all())
    assert len(buckets.all()) == len(plain.all()) + 2 * 2
