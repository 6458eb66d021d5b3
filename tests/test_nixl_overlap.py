"""A NIXL block read overlapped with the decode step: the request runs in the step that
starts its read, each attention layer waiting for its own layer's blocks (the reader thread
posts one READ per layer, in layer order).

Two engines and two NIXL agents in one process (tests/test_kv_transport.py's ``pair``); the
reference is one engine generating the whole request. Every test ends with both engines'
stats at their idle baseline and the prefill side's blocks released.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from test_kv_transport import Published, assert_idle, engine, prompts, run_all, wait_released

import deployments.nixl_transport as nixl_transport
from deployments.nixl_transport import NixlBlockRead, NixlTransport
from neuron_runtime import LLMEngine, RequestOutputKind, SamplingParams
from neuron_runtime.model_runner import _cache_readers


@pytest.fixture(scope="module")
def reference(tiny_llama_path) -> LLMEngine:
    return engine(tiny_llama_path)


@pytest.fixture
def pair(tiny_llama_path):
    """(prefill engine, its transport, decode engine, its transport)."""
    prefill = engine(tiny_llama_path, num_kv_blocks=64)
    decode = engine(tiny_llama_path, num_kv_blocks=192)
    # Short: a failed read's notification can be lost (the decode side drops that peer at
    # once), and then the hold's timeout frees the blocks.
    sender = NixlTransport(hold_timeout_s=2.0, publish=Published)
    sender.attach(prefill, prefill.release_kv)
    receiver = NixlTransport(publish=Published, layer_wise=True)
    receiver.attach(decode, decode.abort_request)
    yield prefill, sender, decode, receiver
    sender.close()
    receiver.close()


async def handed_off(pair, tokens: list[int], params: SamplingParams, fail: bool = False):  # noqa: ANN001, ANN201
    """Prefill -> export -> receive: the decode-side handoff (its kv a NixlBlockRead)."""
    prefill, sender, _, receiver = pair
    out = run_all(prefill, [("p", tokens, params, {"export_kv": True})])["p"]
    handoff = sender.export(out.kv_handoff)
    read = await receiver.receive(handoff, 5.0)
    assert isinstance(read, NixlBlockRead)
    read.recompute_on_failure = not fail
    return dataclasses.replace(handoff, kv=read)


async def decode_all(decode, requests: list[tuple[str, list[int], SamplingParams, dict]]) -> dict:  # noqa: ANN001
    """Adds the requests, steps until all finish; {request id: final output}, and per
    request the index of the first step whose outputs carried one of its tokens."""
    for request_id, tokens, sp, kwargs in requests:
        decode.add_request(
            request_id, {"prompt_token_ids": tokens}, sp, RequestOutputKind.DELTA, **kwargs
        )
    final: dict = {}
    tokens_out: dict[str, list[int]] = {}
    first_step: dict[str, int] = {}
    step = 0
    while decode.has_unfinished_requests():
        # In a thread, as the decode replica's engine runs: this loop stays free to run the
        # prefill side's watch, which also progresses its agent (small READs need that).
        for out in await asyncio.to_thread(decode.step):
            if out.outputs[0].token_ids:
                first_step.setdefault(out.request_id, step)
                tokens_out.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                final[out.request_id] = out
        step += 1
    return {"final": final, "tokens": tokens_out, "first_step": first_step}


def test_attention_layers_are_the_cache_readers(pair):
    decode = pair[2]
    readers = _cache_readers(decode.runner.model)
    assert len(readers) == len(decode.runner.kv_caches)
    assert all(type(m).__name__.endswith("Attention") for m, _ in readers)


def test_the_read_runs_under_the_first_decode_step_layer_by_layer(pair, reference, monkeypatch):
    """The handed-off request's first decode token comes out of the very step that started
    its read, beside a running request that is not held up, with the reference's tokens;
    each layer's attention waited for that layer only, in layer order."""
    prefill, _, decode, _ = pair
    tokens, other = prompts(2, base=70)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = run_all(reference, [("a", tokens, sp, {}), ("b", other, sp, {})])
    waits: list[tuple[int, int]] = []  # (layer, layers in when the wait returned)
    plain_wait = NixlBlockRead.wait_layer

    def recording_wait(self: NixlBlockRead, layer: int) -> bool:
        ok = plain_wait(self, layer)
        waits.append((layer, self._layers_in))
        return ok

    monkeypatch.setattr(NixlBlockRead, "wait_layer", recording_wait)

    async def go() -> dict:
        handoff = await handed_off(pair, tokens, sp)
        decode.add_request("b", {"prompt_token_ids": other}, sp, RequestOutputKind.DELTA)
        decode.step()  # b's prompt: b is running when a arrives
        got = await decode_all(decode, [("a", tokens, sp, {"handoff": handoff})])
        await wait_released(prefill)
        got["read"] = handoff.kv
        return got

    got = asyncio.run(go())
    read = got["read"]
    assert read.done_at is not None and read.error is None
    assert got["first_step"]["a"] == 0  # no step without it while its KV landed
    assert got["tokens"]["a"] == want["a"].outputs[0].token_ids[1:]
    assert [w[0] for w in waits] == list(range(len(decode.runner.kv_caches)))
    assert all(layers_in > layer for layer, layers_in in waits)
    b = got["tokens"]["b"]
    assert len(b) == sp.max_tokens - 1 and got["first_step"]["b"] == 0
    assert decode.stats().num_kv_imports == 1
    assert_idle(prefill)
    assert_idle(decode)


def test_a_read_slower_than_the_step_leaves_it_and_joins_later(pair, reference, monkeypatch):
    """Layers that are not in within the join bound: that step's token of the (seeded)
    request is dropped and its generator set back, the request waits outside the batch
    while the running request beside it keeps decoding, then goes on with the reference's
    tokens."""
    prefill, _, decode, _ = pair
    tokens, other = prompts(2, base=60)
    sp = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    other_sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = run_all(reference, [("a", tokens, sp, {}), ("b", other, other_sp, {})])
    monkeypatch.setattr(nixl_transport, "JOIN_WAIT_S", 0.01)
    plain_post = nixl_transport.NixlTransport.post
    posted = []

    def slow_post(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        posted.append(time.perf_counter())
        if len(posted) > 1:
            time.sleep(0.3)  # layers 1.. land long after the join bound
        return plain_post(self, *args, **kwargs)

    monkeypatch.setattr(nixl_transport.NixlTransport, "post", slow_post)

    async def go() -> dict:
        handoff = await handed_off(pair, tokens, sp)
        decode.add_request("b", {"prompt_token_ids": other}, other_sp, RequestOutputKind.DELTA)
        decode.step()  # b's prompt: b is running when a arrives
        got = await decode_all(decode, [("a", tokens, sp, {"handoff": handoff})])
        await wait_released(prefill)
        got["read"] = handoff.kv
        return got

    got = asyncio.run(go())
    assert got["read"].done_at is not None and got["read"].error is None
    assert got["first_step"]["a"] > 1  # the overlapped step's token was dropped
    assert got["first_step"]["b"] == 0  # b decoded while a's KV landed
    assert got["tokens"]["a"] == want["a"].outputs[0].token_ids[1:]
    assert got["tokens"]["b"] == want["b"].outputs[0].token_ids[1:]
    assert_idle(prefill)
    assert_idle(decode)


@pytest.mark.parametrize("policy_fail", [False, True])
def test_a_read_failing_after_some_layers_recomputes_or_fails(
    pair, reference, monkeypatch, policy_fail
):
    """The READ of layer 1 is refused after layer 0's landed and ran: recompute gives
    the reference's tokens, fail ends the request with an error; the running request beside
    it is unaffected; held blocks return to baseline on both sides."""
    prefill, _, decode, _ = pair
    tokens, other = prompts(2, base=50)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = run_all(reference, [("a", tokens, sp, {}), ("b", other, sp, {})])
    plain_post = nixl_transport.NixlTransport.post
    posted = []

    def failing_post(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        posted.append(1)
        if len(posted) == 2:
            raise RuntimeError("NIXL_ERR_BACKEND")
        return plain_post(self, *args, **kwargs)

    monkeypatch.setattr(nixl_transport.NixlTransport, "post", failing_post)

    async def go() -> dict:
        handoff = await handed_off(pair, tokens, sp, fail=policy_fail)
        got = await decode_all(
            decode,
            [("b", other, sp, {}), ("a", tokens, sp, {"handoff": handoff})],
        )
        await wait_released(prefill)
        got["read"] = handoff.kv
        return got

    got = asyncio.run(go())
    assert got["read"].error is not None and "NIXL_ERR_BACKEND" in got["read"].error
    assert got["tokens"]["b"] == want["b"].outputs[0].token_ids
    a = got["final"]["a"]
    if policy_fail:
        assert a.error and "could not be read" in a.error
    else:
        assert a.error is None and got["tokens"]["a"] == want["a"].outputs[0].token_ids[1:]
    assert_idle(prefill)
    assert_idle(decode)
