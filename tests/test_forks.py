"""n > 1: the other samples of a prompt share its full prompt blocks instead of recomputing."""

from __future__ import annotations

import pytest

from neuron_runtime import LLM, SamplingParams


def prompt(first: int) -> dict:
    return {"prompt_token_ids": list(range(first, first + 45))}  # 5 full blocks of 8 + 5


@pytest.fixture(scope="module")
def shared(tiny_llama_path) -> LLM:
    return LLM(model=str(tiny_llama_path), max_model_len=256, num_kv_blocks=128, block_size=8)


@pytest.fixture(scope="module")
def unshared(tiny_llama_path) -> LLM:
    """The reference: no prefix cache, so every sample computes the whole prompt."""
    return LLM(
        model=str(tiny_llama_path),
        max_model_len=256,
        num_kv_blocks=128,
        block_size=8,
        enable_prefix_caching=False,
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=4, temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_forks_share_prompt_blocks_and_match_unshared_samples(shared, unshared, params):
    fresh = prompt(200 if params.greedy else 400)  # not in the prefix cache yet
    before = shared.engine.stats()
    (out,) = shared.generate([fresh], params)
    after = shared.engine.stats()
    (ref,) = unshared.generate([fresh], params)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    # Each of the 3 forks found the leader's 5 full prompt blocks (40 tokens) cached.
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * 40
    assert after.num_kv_blocks_used == after.num_waiting == after.num_running == 0


def test_abort_while_forks_wait_frees_everything(shared):
    engine = shared.engine
    params = SamplingParams(n=3, temperature=0.0, max_tokens=50)
    engine.add_request("fork-abort", {"prompt_token_ids": list(range(300, 360))}, params)
    assert engine.stats().num_waiting == 3
    engine.step()  # the leader's prompt (60 tokens) runs; the forks are released after it
    engine.abort_request("fork-abort")
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_unfinished_outputs) == (0, 0, 0)
    assert stats.num_kv_blocks_used == 0
    assert not engine.has_unfinished_requests()


def test_only_an_unfinished_request_counts_as_aborted(shared):
    """EngineStats.num_aborted (neuron:requests_aborted_total): a request aborted while it
    runs counts once, however many samples it has; aborting a finished one or an unknown id
    does not count."""
    engine = shared.engine
    before = engine.stats().num_aborted
    (done,) = shared.generate([prompt(600)], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.abort_request(done.request_id)
    engine.abort_request("no-such-request")
    assert engine.stats().num_aborted == before
    params = SamplingParams(n=2, temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("abort-count", prompt(700), params)
    engine.step()
    engine.abort_request("abort-count")
    engine.abort_request("abort-count")  # a second abort finds nothing left to end
    assert engine.stats().num_aborted == before + 1
