"""EAGLE across a KV handoff: the prefill engine (it has the EAGLE head) hands off the prompt's
hidden states with its KV, and the decode engine's head drafts from them in the request's
first step there. Greedy tokens equal the engine's without speculation, and the decode
engine's speculation counters equal those of one engine running the same requests with the
same head (it drafts exactly what that engine drafts, from the same step on)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from spec_decode_heads import make_eagle_head

from neuron_runtime.engine import LLMEngine
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.kv_transfer import DraftHidden, KVTransferError
from neuron_runtime.sampling_params import SamplingParams

ARGS = dict(max_model_len=256, num_kv_blocks=128)
PROMPTS = [
    [11, 12, 13, 14, 15, 16, 17, 18] * 4 + [11, 12, 13],
    list(range(300, 340)),
    [7, 8, 9],
]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, tiny_llama_path):
    cfg = json.loads((tiny_llama_path / "config.json").read_text())
    return {
        method: make_eagle_head(tmp_path_factory.mktemp(f"pd-{method}"), cfg, method, seed=3)
        for method in ("eagle", "eagle3")
    }


def engine(path, spec: dict | None = None, **overrides) -> LLMEngine:
    args = {**ARGS, **overrides}
    return LLMEngine.from_engine_args(EngineArgs(model=str(path), speculative_config=spec, **args))


def run(engine: LLMEngine, requests: dict) -> dict[str, list[int]]:
    for req_id, (prompt, kwargs) in requests.items():
        engine.add_request(req_id, prompt, greedy(), **kwargs)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    return final


def record_drafts(engine: LLMEngine) -> dict[int, list[list[int]]]:
    """Request index (the id's digits) -> each draft its proposer made, in order."""
    drafts: dict[int, list[list[int]]] = {}
    proposer = engine.spec.proposer
    propose = proposer.propose

    def recording(requests, num_tokens):
        out = propose(requests, num_tokens)
        for request, draft in zip(requests, out, strict=True):
            drafts.setdefault(int(request.req_id[1:]), []).append(list(draft))
        return out

    proposer.propose = recording
    return drafts


def prefill_all(prefill: LLMEngine) -> dict:
    """Prefill role: each prompt's handoff with its KV copied out (a payload)."""
    for i, prompt in enumerate(PROMPTS):
        prefill.add_request(f"p{i}", prompt, greedy(), export_kv=True)
    handoffs = {}
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            if out.finished:
                handoff = out.kv_handoff
                handoff.kv = prefill.read_kv(handoff)
                prefill.release_kv(handoff.handoff_id)
                handoffs[out.request_id] = handoff
    return handoffs


def check_idle(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == stats.num_unfinished_outputs == 0
    assert stats.num_kv_blocks_used == stats.num_kv_blocks_held == 0
    assert not engine.spec or not engine.spec.proposer._pending


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_decode_engine_drafts_in_its_first_step_from_handed_off_hidden_states(
    tiny_llama_path, heads, method
):
    spec = {"method": method, "num_speculative_tokens": 3, "model": str(heads[method])}
    reference = run(engine(tiny_llama_path), {f"r{i}": (p, {}) for i, p in enumerate(PROMPTS)})
    single = engine(tiny_llama_path, spec)
    single_drafts = record_drafts(single)
    run(single, {f"s{i}": (p, {}) for i, p in enumerate(PROMPTS)})

    # Chunked prefill: the prompt's hidden states come from several steps.
    prefill = engine(tiny_llama_path, spec, max_num_batched_tokens=16)
    handoffs = prefill_all(prefill)
    width = 64 * (3 if method == "eagle3" else 1)  # the tiny model's hidden size is 64
    for i, prompt in enumerate(PROMPTS):
        state = handoffs[f"p{i}"].draft_hidden
        assert state is not None and state.start == 0
        assert state.hidden.shape == (len(prompt), width) and state.hidden.dtype == np.float32
    check_idle(prefill)

    decode = engine(tiny_llama_path, spec)
    decode_drafts = record_drafts(decode)
    for i, prompt in enumerate(PROMPTS):
        decode.add_request(f"d{i}", prompt, greedy(), handoff=handoffs[f"p{i}"])
    decode.step()  # the requests' first step here
    first = decode.stats().spec_decode
    assert first.num_drafts == len(PROMPTS) and first.num_draft_tokens == 3 * len(PROMPTS)
    final = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert [final[f"d{i}"] for i in range(len(PROMPTS))] == [
        reference[f"r{i}"] for i in range(len(PROMPTS))
    ]
    # The same drafts, verified in the same order, as one engine with the head.
    assert decode_drafts == single_drafts
    assert decode.stats().spec_decode == single.stats().spec_decode
    check_idle(decode)


def test_without_hidden_states_the_first_step_does_not_draft(tiny_llama_path, heads):
    """A prefill engine without an EAGLE head hands off no hidden states: the decode engine's
    head drafts only once the request has run a step there."""
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(heads["eagle"])}
    handoffs = prefill_all(engine(tiny_llama_path))
    assert all(h.draft_hidden is None for h in handoffs.values())
    decode = engine(tiny_llama_path, spec)
    decode.add_request("d0", PROMPTS[0], greedy(), handoff=handoffs["p0"])
    decode.step()
    assert decode.stats().spec_decode.num_drafts == 0
    while decode.has_unfinished_requests():
        decode.step()
    assert decode.stats().spec_decode.num_drafts > 0
    check_idle(decode)


def test_hidden_states_that_do_not_fit_fail_that_request(tiny_llama_path, heads):
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(heads["eagle"])}
    handoffs = prefill_all(engine(tiny_llama_path, spec))
    decode = engine(tiny_llama_path, spec)
    good = handoffs["p0"].draft_hidden
    assert good is not None
    for bad in (
        DraftHidden(0, good.hidden[1:]),  # a row short of the prompt
        DraftHidden(0, np.zeros((len(PROMPTS[0]), 32), np.float32)),  # another hidden size
        DraftHidden(0, good.hidden.astype(np.float64)),
    ):
        handoffs["p0"].draft_hidden = bad
        with pytest.raises(KVTransferError, match="EAGLE hidden states"):
            decode.add_request("d0", PROMPTS[0], greedy(), handoff=handoffs["p0"])
    # The other requests go on.
    final = run(decode, {"d1": (PROMPTS[1], {"handoff": handoffs["p1"]})})
    assert len(final["d1"]) == 20
    check_idle(decode)
