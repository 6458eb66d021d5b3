"""The gloo KV transport without Serve: a prefill-side and a decode-side transport in one
process, talking over 127.0.0.1 as two replicas would."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
from torch.distributed import TCPStore

from deployments.gloo_transport import GlooTransport, Outbox, pair_group
from deployments.kv_transport import (
    GlooTicket,
    KVTransportConfig,
    KVTransportError,
    make_transport,
)
from neuron_runtime.kv_transfer import KVMetadata, KVPayload


def payload(num_tokens: int = 40, seed: int = 0, layers: int = 3, heads: int = 2, dim: int = 8):
    metadata = KVMetadata(
        model_id="m",
        config_hash="h",
        dtype="float32",
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=dim,
        num_tokens=num_tokens,
        block_hashes=(),
    )
    kv = np.random.default_rng(seed).standard_normal(metadata.shape, dtype=np.float32)
    return KVPayload(metadata, kv)


@pytest.fixture
def pair():
    prefill = GlooTransport(outbox_timeout_s=30, outbox_max_bytes=1 << 30)
    decode = GlooTransport(outbox_timeout_s=30, outbox_max_bytes=1 << 30)
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def test_concurrent_fetches_return_the_exported_arrays(pair):
    prefill, decode = pair
    sent = [payload(num_tokens=16 + i, seed=i) for i in range(6)]
    tickets = [prefill.export(p) for p in sent]
    assert prefill.num_outbox() == 6

    async def fetch_all() -> list[KVPayload]:
        return await asyncio.gather(*(decode.fetch(t, 10.0) for t in tickets))

    got = asyncio.run(fetch_all())
    for a, b in zip(sent, got, strict=True):
        assert b.metadata == a.metadata
        np.testing.assert_array_equal(b.kv, a.kv)
    assert prefill.num_outbox() == 0
    # Each transfer's rendezvous keys are deleted once it is done.
    store = TCPStore("127.0.0.1", tickets[0].port, None, False, timedelta(seconds=5))
    deadline = time.monotonic() + 5
    while store.list_keys() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.list_keys() == []


def test_a_large_payload_arrives_whole(pair):
    prefill, decode = pair
    sent = payload(num_tokens=1024, layers=30, heads=3, dim=64)  # SmolLM2's KV shape: 47 MB
    got = asyncio.run(decode.fetch(prefill.export(sent), 30.0))
    np.testing.assert_array_equal(got.kv, sent.kv)


def test_a_ticket_is_redeemed_once_and_a_missing_transfer_raises_at_once(pair):
    prefill, decode = pair
    ticket = prefill.export(payload())
    asyncio.run(decode.fetch(ticket, 10.0))
    start = time.monotonic()
    with pytest.raises(KVTransportError, match="has no KV transfer"):
        asyncio.run(decode.fetch(ticket, 10.0))
    assert time.monotonic() - start < 5


def test_a_dead_or_silent_peer_raises_within_the_timeout(pair):
    _, decode = pair
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        for port in (free_port, silent.getsockname()[1]):
            ticket = GlooTicket("127.0.0.1", port, "t", payload().metadata)
            start = time.monotonic()
            with pytest.raises((KVTransportError, TimeoutError)):
                asyncio.run(decode.fetch(ticket, 1.0))
            assert time.monotonic() - start < 2.0
    finally:
        silent.close()


def test_outbox_expires_and_drops_the_oldest_when_full():
    one = payload().nbytes
    outbox = Outbox(timeout_s=0.2, max_bytes=2 * one)
    first, second, third = (outbox.put(payload()) for _ in range(3))
    assert len(outbox) == 2 and outbox.nbytes == 2 * one and outbox.take(first) is None
    assert outbox.take(second) is not None and outbox.nbytes == one
    time.sleep(0.3)
    assert len(outbox) == 0 and outbox.nbytes == 0 and outbox.take(third) is None
    big = outbox.put(payload(num_tokens=400))  # larger than the bound: kept alone
    assert len(outbox) == 1 and outbox.take(big) is not None


def test_expired_payloads_are_freed_without_any_call():
    prefill = GlooTransport(outbox_timeout_s=0.3, outbox_max_bytes=1 << 30)
    try:
        prefill.export(payload())
        time.sleep(1.0)
        assert prefill.outbox.nbytes == 0  # reading nbytes expires nothing itself
    finally:
        prefill.close()


def test_listeners_are_on_loopback_only(pair):
    """The store's listener, and gloo's while a pair group waits for its peer."""
    prefill, decode = pair
    ticket = prefill.export(payload())
    asyncio.run(decode.fetch(ticket, 10.0))
    store = TCPStore("127.0.0.1", ticket.port, None, False, timedelta(seconds=5))
    waiting = threading.Thread(target=_pair_group_alone, args=(store,))
    waiting.start()
    time.sleep(0.5)
    try:
        ss = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=False)
    finally:
        waiting.join()
    if ss.returncode != 0:
        pytest.skip("ss is not available")
    ours = [line for line in ss.stdout.splitlines() if f"pid={os.getpid()}," in line]
    assert len(ours) >= 2, ss.stdout
    for line in ours:
        local = line.split()[3]
        assert local.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")), line


def _pair_group_alone(store: TCPStore) -> None:
    # Holds gloo's listener open until the rendezvous times out: no rank 1 ever comes.
    with contextlib.suppress(RuntimeError):
        pair_group(store, "alone", 0, timeout_s=1.5)


def test_config_names_the_transport():
    assert make_transport(KVTransportConfig()).name == "object_store"
    assert isinstance(make_transport(KVTransportConfig("gloo")), GlooTransport)
    with pytest.raises(ValueError, match="outbox_max_bytes"):
        KVTransportConfig("gloo", outbox_max_bytes=0)
