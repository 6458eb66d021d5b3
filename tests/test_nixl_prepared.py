"""NIXL reads from prepared descriptor lists: the cell indices name the right memory, and a
loaded peer stays usable by the reads that hold it when it is dropped, then is released.

The cell addresses are checked against the cache tensors' own element addresses (torch
indexing); reads against one engine generating the whole request (tests/test_kv_transport.py's
``pair``), with both engines idle and the prefill blocks released afterwards.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from test_kv_transport import (
    Published,
    assert_idle,
    engine,
    hand_over,
    prompts,
    run_all,
    wait_released,
)

import deployments.nixl_transport as nixl_transport
from deployments.nixl_transport import NixlBlockRead, NixlTransport, cache_cells, layer_cells
from neuron_runtime import SamplingParams
from neuron_runtime.kv_layout import cache_layout, region_addresses


@pytest.fixture(scope="module")
def reference(tiny_llama_path):  # noqa: ANN001, ANN201
    return engine(tiny_llama_path)


@pytest.fixture
def pair(tiny_llama_path):  # noqa: ANN001, ANN201
    """(prefill engine, its transport, decode engine, its transport)."""
    prefill = engine(tiny_llama_path, num_kv_blocks=64)
    decode = engine(tiny_llama_path, num_kv_blocks=192)
    sender = NixlTransport(hold_timeout_s=5.0, publish=Published)
    sender.attach(prefill, prefill.release_kv)
    receiver = NixlTransport(publish=Published)
    receiver.attach(decode, decode.abort_request)
    yield prefill, sender, decode, receiver
    sender.close()
    receiver.close()


def test_cells_name_each_layer_head_and_block_of_the_cache():
    """Row ``layer_cells(...)[l][i]`` of ``cache_cells`` is the address and size of the i-th
    (K/V, head, block) of layer l, in that order, as torch addresses them."""
    heads, num_blocks, block_size, head_dim = 3, 7, 4, 8
    shape = (heads, num_blocks, block_size, head_dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(2)]
    layout = cache_layout(caches)
    rows = cache_cells(region_addresses(caches), layout)
    blocks = [5, 2, 3]
    cells = layer_cells(layout, num_blocks, blocks)
    assert cells.shape == (2, 2 * heads * len(blocks))
    for layer, kv in enumerate(caches):
        want = [
            (t[h, b].data_ptr(), t[h, b].numel() * t.element_size())
            for t in kv
            for h in range(heads)
            for b in blocks
        ]
        got = [(int(rows[i, 0]), int(rows[i, 1])) for i in cells[layer]]
        assert got == want


def test_a_peer_dropped_during_a_read_is_released_after_it(pair, reference, monkeypatch):
    """The prefill agent is dropped (as a failed read or eviction would) while a received
    read still holds it: that read runs from the link and gives the reference's tokens; the
    peer's descriptor list and agent are released only then; the next ticket loads it
    again and reads correctly."""
    prefill, sender, decode, receiver = pair
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tokens = prompts(2, base=40)
    want = run_all(reference, [(f"r{i}", t, sp, {}) for i, t in enumerate(tokens)])
    dropped: list[str] = []
    plain_drop = nixl_transport.NixlTransport._drop

    def recording_drop(self, link):  # noqa: ANN001, ANN202
        dropped.append(link.name)
        return plain_drop(self, link)

    monkeypatch.setattr(nixl_transport.NixlTransport, "_drop", recording_drop)
    plain_receive = receiver.receive

    async def receive_then_drop(handoff, timeout_s):  # noqa: ANN001, ANN202
        kv = await plain_receive(handoff, timeout_s)
        assert isinstance(kv, NixlBlockRead) and kv.link.users == 1
        receiver.forget_peer(kv.link.name)
        assert dropped == [] and receiver._retired == {kv.link.name: kv.link}
        return kv

    async def go() -> None:
        receiver.receive = receive_then_drop
        final, received = await hand_over(pair, [tokens[0]], [sp])
        assert final["d0"].outputs[0].token_ids == want["r0"].outputs[0].token_ids
        assert received[0].done_at is not None and received[0].error is None
        await wait_released(prefill)
        assert dropped == [sender.agent.name]
        assert receiver._retired == {} and receiver._peers == {}

        receiver.receive = plain_receive
        final, received = await hand_over(pair, [tokens[1]], [sp])
        assert final["d0"].outputs[0].token_ids == want["r1"].outputs[0].token_ids
        await wait_released(prefill)
        assert list(receiver._peers) == [sender.agent.name]
        assert receiver._peers[sender.agent.name].users == 0

    asyncio.run(go())
    assert_idle(prefill)
    assert_idle(decode)


@pytest.mark.parametrize("started", [False, True])
def test_an_abandoned_read_lets_its_peer_go(pair, started):
    """A read the engine never started (the request left first) and one that ran both give
    back their hold on the peer exactly once, however often ``abandon`` is called."""
    prefill, _, decode, receiver = pair
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    tokens = prompts(1, base=33)
    if started:

        async def run_and_wait() -> NixlBlockRead:
            _, received = await hand_over(pair, tokens, [sp])
            await wait_released(prefill)
            return received[0]

        read = asyncio.run(run_and_wait())
        deadline = time.monotonic() + 5
        while read._link_held:  # the reader thread lets go right after the last READ
            assert time.monotonic() < deadline
            time.sleep(0.001)
    else:
        _, sender, _, _ = pair
        out = run_all(prefill, [("p", tokens[0], sp, {"export_kv": True})])["p"]

        async def receive_and_leave() -> NixlBlockRead:
            read = await receiver.receive(sender.export(out.kv_handoff), 5.0)
            assert isinstance(read, NixlBlockRead) and read.link.users == 1
            read.abandon()  # its notification frees the prefill blocks
            await wait_released(prefill)
            return read

        read = asyncio.run(receive_and_leave())
    read.abandon()
    read.abandon()
    assert read.link.users == 0
    assert_idle(prefill)
    assert_idle(decode)
