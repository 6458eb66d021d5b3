"""KV handoff between two engines (prefill role -> decode role), without Ray.

The reference is one engine generating the whole request (itself checked against
transformers in test_llama_vs_hf.py): a handed-off request must give the same tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from neuron_runtime import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from neuron_runtime.kv_transfer import KVHandoff, KVMetadata, KVPayload, KVTransferError

MAX_MODEL_LEN = 512
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea. The sea",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23,",
    "In a distant galaxy, a small robot named Pip woke up and looked around at the strange "
    "purple forest. The trees were tall and the sky was green. Pip decided to",
    "def fibonacci(n):",
    "Q: What is the boiling point of water at sea level?\nA:",
]


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def engine(model_path, **overrides) -> LLMEngine:
    args = dict(model=str(model_path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=128)
    args.update(overrides)
    return LLMEngine.from_engine_args(EngineArgs(**args))


def run_all(eng: LLMEngine, requests: list[tuple[str, object, SamplingParams, dict]]) -> dict:
    """Adds every request at once, steps until idle; request id -> final output."""
    for request_id, prompt, params, kwargs in requests:
        eng.add_request(request_id, prompt, params, RequestOutputKind.CUMULATIVE, **kwargs)
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    return final


def batch(prefix: str, prompts: list, params: list, key: str | None = None, values=()) -> list:
    """(request id, prompt, params, add_request kwargs) for each prompt."""
    extra = list(values) or [None] * len(prompts)
    return [
        (f"{prefix}{i}", prompt, sp, {key: value} if key else {})
        for i, (prompt, sp, value) in enumerate(zip(prompts, params, extra, strict=True))
    ]


def assert_idle(eng: LLMEngine) -> None:
    stats = eng.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_unfinished_outputs) == (0, 0, 0)
    assert stats.num_kv_blocks_used == 0
    assert not eng._handoffs


@pytest.fixture(scope="module")
def prefill(default_model_path) -> LLMEngine:
    return engine(default_model_path)


@pytest.fixture(scope="module")
def decode(default_model_path) -> LLMEngine:
    # Another block size than the prefill side: the payload is per token, not per block.
    return engine(default_model_path, block_size=8, num_kv_blocks=256)


@pytest.fixture(scope="module")
def reference(default_model_path) -> LLMEngine:
    return engine(default_model_path)


def hand_off(prefill: LLMEngine, prompts: list, params: list[SamplingParams]) -> dict:
    """The prefill role's outputs; each handoff's KV copied out of its held blocks (``kv``),
    then the blocks released."""
    outs = run_all(prefill, batch("p", prompts, params, "export_kv", [True] * len(prompts)))
    for out in outs.values():
        handoff = out.kv_handoff
        if handoff is not None:
            assert prefill.stats().num_kv_blocks_held >= len(handoff.block_ids) > 0
            handoff.kv = prefill.read_kv(handoff)
            assert prefill.release_kv(handoff.handoff_id)
    assert_idle(prefill)
    return {i: outs[f"p{i}"] for i in range(len(prompts))}


def continue_all(decode: LLMEngine, prompts: list, params: list, handoffs: list) -> dict:
    outs = run_all(decode, batch("d", prompts, params, "handoff", handoffs))
    assert_idle(decode)
    return {i: outs[f"d{i}"] for i in range(len(prompts))}


def test_handoff_of_a_concurrent_batch_equals_one_engine(prefill, decode, reference):
    params = [greedy(8 + 4 * i) for i in range(len(PROMPTS))]
    expected = run_all(reference, batch("r", PROMPTS, params))
    pre = hand_off(prefill, PROMPTS, params)
    for i, out in pre.items():
        assert out.finished and out.outputs[0].finish_reason is None  # it goes on elsewhere
        assert out.outputs[0].token_ids == expected[f"r{i}"].outputs[0].token_ids[:1]
        meta = out.kv_handoff.metadata
        assert meta.num_tokens == len(out.prompt_token_ids)
        assert out.kv_handoff.kv.kv.shape == meta.shape
        assert len(out.kv_handoff.block_ids) == -(-meta.num_tokens // 16)
    dec = continue_all(decode, PROMPTS, params, [pre[i].kv_handoff for i in pre])
    for i in range(len(PROMPTS)):
        ref = expected[f"r{i}"].outputs[0]
        assert dec[i].outputs[0].token_ids == ref.token_ids, PROMPTS[i]
        assert dec[i].outputs[0].text == ref.text
        assert dec[i].outputs[0].finish_reason == "length"


def test_seeded_sampling_continues_across_the_handoff(prefill, decode, reference):
    params = [
        SamplingParams(temperature=1.0, top_p=0.95, seed=11 + i, max_tokens=20, ignore_eos=True)
        for i in range(3)
    ]
    prompts = PROMPTS[:3]
    expected = run_all(reference, batch("s", prompts, params))
    pre = hand_off(prefill, prompts, params)
    assert all(pre[i].kv_handoff.generator_state is not None for i in pre)
    dec = continue_all(decode, prompts, params, [pre[i].kv_handoff for i in pre])
    for i in range(len(prompts)):
        assert dec[i].outputs[0].token_ids == expected[f"s{i}"].outputs[0].token_ids


def test_recompute_without_payload_gives_the_same_tokens(prefill, decode, reference):
    params = [greedy(16)] * 2
    prompts = PROMPTS[2:4]
    expected = run_all(reference, batch("c", prompts, params))
    pre = hand_off(prefill, prompts, params)
    lost = [dataclasses.replace(pre[i].kv_handoff, kv=None) for i in pre]
    dec = continue_all(decode, prompts, params, lost)
    for i in range(len(prompts)):
        assert dec[i].outputs[0].token_ids == expected[f"c{i}"].outputs[0].token_ids


def test_decode_preemption_recomputes_imported_requests(default_model_path, prefill, reference):
    # 16 blocks of 8 tokens cannot hold four sequences of 50-120 tokens at once.
    small = engine(default_model_path, block_size=8, num_kv_blocks=16, max_model_len=128)
    prompts, params = PROMPTS[:4], [greedy(40)] * 4
    expected = run_all(reference, batch("q", prompts, params))
    pre = hand_off(prefill, prompts, params)
    dec = continue_all(small, prompts, params, [pre[i].kv_handoff for i in pre])
    assert small.stats().num_preemptions > 0
    for i in range(len(prompts)):
        assert dec[i].outputs[0].token_ids == expected[f"q{i}"].outputs[0].token_ids


def test_request_ending_on_its_first_token_is_not_handed_off(prefill):
    out = run_all(prefill, [("one", PROMPTS[0], greedy(1), {"export_kv": True})])["one"]
    assert out.outputs[0].finish_reason == "length"
    assert out.kv_handoff is None
    assert_idle(prefill)


def tampered(handoff: KVHandoff, **meta_changes) -> KVHandoff:
    payload = handoff.kv
    assert isinstance(payload, KVPayload)
    meta = dataclasses.replace(payload.metadata, **meta_changes)
    return dataclasses.replace(handoff, kv=KVPayload(meta, payload.kv))


def test_inconsistent_payload_fails_only_that_request(prefill, decode):
    prompt = PROMPTS[1]
    first = hand_off(prefill, [prompt], [greedy(8)])[0]
    handoff, ids = first.kv_handoff, first.prompt_token_ids
    payload = handoff.kv
    bad = {
        "config_hash": tampered(handoff, config_hash="0" * 16),
        "num_kv_heads": tampered(handoff, num_kv_heads=4),
        "num_tokens": tampered(handoff, num_tokens=payload.metadata.num_tokens - 1),
        "other prompt": tampered(handoff, block_hashes=("ab" * 16,)),
        "array shape": dataclasses.replace(
            handoff, kv=KVPayload(payload.metadata, payload.kv[:, :, :, :-1])
        ),
        "array dtype": dataclasses.replace(
            handoff, kv=KVPayload(payload.metadata, payload.kv.astype(np.float64))
        ),
    }
    for name, broken in bad.items():
        with pytest.raises(KVTransferError):
            decode.add_request(f"bad-{name}", prompt, greedy(8), handoff=broken)
    # The same payload offered for a prompt of the same length but one other token.
    other = {"prompt_token_ids": ids[:-1] + [ids[-1] + 1]}
    with pytest.raises(KVTransferError, match="other prompt tokens"):
        decode.add_request("wrong-prompt", other, greedy(8), handoff=handoff)
    assert_idle(decode)
    good = continue_all(decode, [prompt], [greedy(8)], [handoff])
    assert len(good[0].outputs[0].token_ids) == 8


def test_handoff_rejects_n_above_one_and_empty_tokens(prefill, decode):
    with pytest.raises(ValueError, match="n > 1"):
        prefill.add_request("n2", PROMPTS[0], SamplingParams(n=2, max_tokens=4), export_kv=True)
    with pytest.raises(ValueError, match="tokens the prefill side produced"):
        metadata = KVMetadata("m", "h", "float32", 1, 1, 1, 1, ())
        decode.add_request("empty", PROMPTS[0], greedy(4), handoff=KVHandoff(metadata, []))
    assert_idle(prefill)
    assert_idle(decode)


def test_handed_off_blocks_stay_held_until_released_or_aborted(prefill):
    """The prefill side holds a handed-off prompt's blocks outside its running batch; a
    release (or an abort naming the handoff id) frees them, and a second one is a no-op."""
    outs = run_all(prefill, batch("h", PROMPTS[:2], [greedy(8)] * 2, "export_kv", [True] * 2))
    handoffs = [out.kv_handoff for out in outs.values()]
    stats = prefill.stats()
    assert stats.num_running == stats.num_waiting == stats.num_unfinished_outputs == 0
    held = sum(len(h.block_ids) for h in handoffs)
    assert stats.num_kv_blocks_held == stats.num_kv_blocks_used == held
    assert prefill.release_kv(handoffs[0].handoff_id)
    assert not prefill.release_kv(handoffs[0].handoff_id)
    assert prefill.abort_request(handoffs[1].handoff_id) is None
    assert prefill.stats().num_kv_blocks_held == 0
    assert_idle(prefill)


def test_abort_of_an_imported_request_frees_its_blocks(prefill, decode):
    handoff = hand_off(prefill, [PROMPTS[3]], [greedy(64)])[0].kv_handoff
    decode.add_request("abort-me", PROMPTS[3], greedy(64), handoff=handoff)
    for _ in range(3):
        decode.step()
    assert decode.stats().num_kv_blocks_used > 0
    final = decode.abort_request("abort-me")
    assert final is not None and final.outputs[0].finish_reason == "abort"
    assert_idle(decode)
