"""The NIXL KV transport: the decode replica reads the prefill replica's cache blocks into its own.

Each engine replica creates one NIXL agent when it starts and registers its whole KV cache
with it (2 regions per layer on huge pages, neuron_runtime/kv_layout.py). The agent has no
progress thread: the decode engine's polls drive its reads and the prefill replica's watch of
its holds collects the notifications. What a peer needs to reach that
memory (the agent's metadata: connection details and memory keys; the regions' addresses; the
cache layout) is put into Ray's object store once, and every ticket carries that ref: a decode
replica loads a prefill agent the first time one of its tickets arrives. No socket of ours.

    prefill replica                                   decode replica
    engine: first token out, prompt blocks held
    export: ticket(agent, info ref, handoff id,
            expiry) ----------- router ------------>  receive: load the agent (once), check
                                                       the layouts; equal -> a block read
                                                      engine: allocates the prompt's blocks,
                                                       start(): one READ, a descriptor per
                                                       (layer, K/V, head, run of blocks)
    notification "handoff id"  <-------------------   (sent by NIXL when the READ completes)
    release: engine frees the blocks                   poll() -> done: the request runs

The prefill replica frees the blocks on that notification or ``hold_timeout_s`` after the
export, whichever comes first; the decode side gives up a read that has not completed a
margin before that expiry (its data is then never used: the prompt is recomputed or the
request fails, per policy). Caches of another layout (block size) are read into a staging
buffer laid out like the prefill cache and imported as tokens (``nixl_tokens`` in metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from deployments.kv_transport import KVTransport, KVTransportError
from neuron_runtime.kv_layout import (
    KVLayout,
    cache_layout,
    cache_regions,
    read_descriptors,
    region_addresses,
    use_huge_pages,
)
from neuron_runtime.kv_transfer import (
    KVBlockSource,
    KVHandoff,
    KVImport,
    KVPayload,
    KVTransferError,
)

logger = logging.getLogger("ray.serve")

# A read must complete this long before the prefill replica frees the blocks it reads.
EXPIRY_MARGIN_S = 1.0
# How often a prefill replica looks for completion notifications while it holds blocks.
NOTIFY_POLL_S = 0.001
# Prefill agents a decode replica keeps loaded (the least recently used is dropped).
MAX_PEERS = 64


@dataclass(frozen=True)
class NixlAgentInfo:
    """What a peer needs to read one agent's KV cache; put into the object store once."""

    name: str
    metadata: bytes  # nixl_agent.get_agent_metadata(): connection details and memory keys
    region_addresses: tuple[int, ...]  # kv_layout.region_addresses order
    layout: KVLayout


@dataclass(frozen=True)
class NixlTicket:
    """Where a handed-off prompt's blocks are: which agent, and until when."""

    agent_name: str
    agent_info: Any  # ray.ObjectRef of the prefill agent's NixlAgentInfo
    expires_at: float  # time.time() at which the prefill replica frees the blocks
    transport: str = "nixl"


class NixlTransport(KVTransport):
    """One replica's NIXL agent: its cache registered, peers loaded on demand."""

    name = "nixl"

    def __init__(
        self,
        backend: str = "UCX",
        hold_timeout_s: float = 30.0,
        publish: Callable[[NixlAgentInfo], Any] | None = None,
    ) -> None:
        """``publish``: makes this agent's info reachable by peers and returns the awaitable
        reference that tickets carry (default ``ray.put``)."""
        self.backend = backend
        self.hold_timeout_s = hold_timeout_s
        self.publish = publish
        self.agent: Any = None
        self.info_ref: Any = None
        self.layout: KVLayout | None = None
        self._addresses: tuple[int, ...] = ()
        self._held: dict[str, float] = {}  # handoff id -> expiry (prefill side)
        self._notify_task: asyncio.Task | None = None
        self._peers: OrderedDict[str, NixlAgentInfo] = OrderedDict()  # decode side
        self._peers_lock = threading.Lock()

    def attach(self, engine: Any, release: Any) -> None:
        """Creates the agent and registers the engine's whole KV cache with it, once."""
        super().attach(engine, release)
        kv_caches = engine.runner.kv_caches
        self.layout = cache_layout(kv_caches)
        name = f"neuron-kv-{uuid.uuid4().hex[:12]}"
        # No progress thread: NIXL's polls without pause and takes a whole core per replica
        # (two of this box's two with a prefill and a decode replica). Reads progress where
        # they are polled (the decode engine's step), notifications where they are collected
        # (_watch_holds on the prefill replica).
        config = nixl_agent_config(
            enable_prog_thread=False,
            backends=[self.backend],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            agent = nixl_agent(name, config)
        except Exception as exc:  # noqa: BLE001 - a plugin that fails to load (no libfabric)
            raise ValueError(f"NIXL backend {self.backend!r} does not start here: {exc}") from exc
        if self.backend not in agent.backends:
            raise ValueError(
                f"NIXL backend {self.backend!r} is not available here (plugins: "
                f"{agent.get_plugin_list()})"
            )
        regions = cache_regions(kv_caches)
        huge = use_huge_pages(regions)
        logger.info(
            "NIXL agent %s (%s): KV cache of %d regions registered, %.0f of %.0f MiB in huge pages",
            name,
            self.backend,
            len(regions),
            huge / 2**20,
            sum(r.numel() * r.element_size() for r in regions) / 2**20,
        )
        self._registration = agent.register_memory(regions)
        self.agent = agent
        self._addresses = region_addresses(kv_caches)
        info = NixlAgentInfo(name, agent.get_agent_metadata(), self._addresses, self.layout)
        if self.publish is None:
            import ray

            self.info_ref = ray.put(info)
        else:
            self.info_ref = self.publish(info)

    # -- prefill side ------------------------------------------------------------------------

    def export(self, handoff: KVHandoff) -> KVHandoff:
        expires_at = time.time() + self.hold_timeout_s
        self._held[handoff.handoff_id] = expires_at
        if self._notify_task is None or self._notify_task.done():
            self._notify_task = asyncio.get_running_loop().create_task(self._watch_holds())
        ticket = NixlTicket(self.agent.name, self.info_ref, expires_at)
        return dataclasses.replace(handoff, ticket=ticket)

    def num_held(self) -> int:
        return len(self._held)

    async def _watch_holds(self) -> None:
        """Frees held blocks on each completion notification, or at expiry."""
        while self._held:
            for messages in self.agent.get_new_notifs().values():
                for message in messages:
                    self._free(message.decode())
            now = time.time()
            for handoff_id in [h for h, expiry in self._held.items() if expiry <= now]:
                logger.warning("KV of %s was not read in time: freeing its blocks", handoff_id)
                self._free(handoff_id)
            await asyncio.sleep(NOTIFY_POLL_S)

    def _free(self, handoff_id: str) -> None:
        if self._held.pop(handoff_id, None) is not None:
            self.release(handoff_id)

    # -- decode side -------------------------------------------------------------------------

    async def receive(self, handoff: KVHandoff, timeout_s: float) -> KVImport:
        ticket = handoff.ticket
        if not isinstance(ticket, NixlTicket):
            raise KVTransportError(f"a nixl replica was given {ticket!r}")
        assert self.layout is not None and handoff.layout is not None
        deadline = min(time.time() + timeout_s, ticket.expires_at - EXPIRY_MARGIN_S)
        if time.time() >= deadline:
            raise KVTransportError(f"the KV of {handoff.handoff_id} expires too soon to read")
        peer = await self._peer(ticket, deadline)
        mismatch = self.layout.mismatch(handoff.layout)
        if mismatch is None:
            return NixlBlockRead(self, peer, handoff, deadline)
        logger.info(
            "KV of %s: cache layouts differ (%s); reading it as tokens",
            handoff.handoff_id,
            mismatch,
        )
        return await self._read_tokens(peer, handoff, deadline)

    async def _peer(self, ticket: NixlTicket, deadline: float) -> NixlAgentInfo:
        with self._peers_lock:
            peer = self._peers.get(ticket.agent_name)
            if peer is not None:
                self._peers.move_to_end(ticket.agent_name)
                return peer
        info = await asyncio.wait_for(ticket.agent_info, max(0.0, deadline - time.time()))
        assert isinstance(info, NixlAgentInfo) and info.name == ticket.agent_name
        with self._peers_lock:
            if info.name in self._peers:
                return info
            self.agent.add_remote_agent(info.metadata)
            self._peers[info.name] = info
            while len(self._peers) > MAX_PEERS:
                old, _ = self._peers.popitem(last=False)
                self.agent.remove_remote_agent(old)
        # Connect now rather than on the first READ (tens of ms here), off the event loop.
        await asyncio.to_thread(self.agent.make_connection, info.name)
        return info

    def notify(self, peer: NixlAgentInfo, handoff_id: str) -> None:
        """Tells a prefill replica to free a handoff's blocks now (best effort)."""
        with contextlib.suppress(Exception):
            self.agent.send_notif(peer.name, handoff_id.encode())

    def forget_peer(self, name: str) -> None:
        """Drops a peer whose transfer failed: it may be gone; a later ticket loads it again."""
        with self._peers_lock:
            if self._peers.pop(name, None) is not None:
                with contextlib.suppress(Exception):
                    self.agent.remove_remote_agent(name)

    def post_read(
        self,
        peer: NixlAgentInfo,
        src_blocks: list[int],
        dst_addresses: tuple[int, ...],
        dst_layout: KVLayout,
        dst_blocks: list[int],
        notification: str,
    ) -> Any:
        """One READ of ``src_blocks`` of the peer's cache into ``dst_blocks``; its handle."""
        src_rows, dst_rows = read_descriptors(
            dst_layout,
            peer.region_addresses,
            peer.layout.num_blocks,
            src_blocks,
            dst_addresses,
            dst_blocks,
        )
        local = self.agent.get_xfer_descs(dst_rows, "DRAM")
        remote = self.agent.get_xfer_descs(src_rows, "DRAM")
        handle = self.agent.initialize_xfer("READ", local, remote, peer.name, notification.encode())
        if self.agent.transfer(handle) == "ERR":
            self.finish(handle)
            raise KVTransferError(f"NIXL could not post the read from {peer.name}")
        return handle

    def state(self, handle: Any) -> str:
        return self.agent.check_xfer_state(handle)

    def finish(self, handle: Any) -> None:
        """Releases a transfer handle (cancelling the transfer if it is still running)."""
        with contextlib.suppress(Exception):
            self.agent.release_xfer_handle(handle)

    async def _read_tokens(
        self, peer: NixlAgentInfo, handoff: KVHandoff, deadline: float
    ) -> KVPayload:
        """The fallback for caches of another layout: the prefill blocks into a staging buffer
        laid out like a cache of theirs, then the tokens as a payload."""
        src = peer.layout
        num_blocks = len(handoff.block_ids)
        shape = (src.num_regions, src.num_kv_heads, num_blocks, src.block_size, src.head_dim)
        stage = torch.empty(shape)
        registration = self.agent.register_memory([stage])
        try:
            addresses = tuple(stage[r].data_ptr() for r in range(src.num_regions))
            handle = self.post_read(
                peer,
                list(handoff.block_ids),
                addresses,
                dataclasses.replace(src, num_blocks=num_blocks),
                list(range(num_blocks)),
                handoff.handoff_id,
            )
            try:
                while (state := self.state(handle)) == "PROC" and time.time() < deadline:
                    await asyncio.sleep(0.0005)
            finally:
                self.finish(handle)
        finally:
            self.agent.deregister_memory(registration)
        if state != "DONE":
            self.forget_peer(peer.name)
            raise KVTransportError(f"NIXL read of {handoff.handoff_id} ended {state}")
        num_tokens = handoff.metadata.num_tokens
        # [2L, kvh, blocks, bs, d] -> [L, 2, kvh, tokens, d] -> [2, L, kvh, tokens, d]
        tokens = stage.view(src.num_layers, 2, src.num_kv_heads, -1, src.head_dim)
        kv = tokens[:, :, :, :num_tokens].transpose(0, 1).contiguous().numpy()
        return KVPayload(handoff.metadata, kv)

    def close(self) -> None:
        if self._notify_task is not None:
            self._notify_task.cancel()
        if self.agent is not None:
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(self._registration)
            self.agent = None


class NixlBlockRead(KVBlockSource):
    """One handed-off prompt read block by block into the decode engine's cache.

    ``start`` and ``poll`` run on the engine's loop thread; the timings are read by the decode
    replica afterwards for its transfer metrics.
    """

    def __init__(
        self,
        transport: NixlTransport,
        peer: NixlAgentInfo,
        handoff: KVHandoff,
        deadline: float,
        recompute_on_failure: bool = True,
    ) -> None:
        assert handoff.layout is not None
        self.transport = transport
        self.peer = peer
        self.handoff = handoff
        self.metadata = handoff.metadata
        self.layout = handoff.layout
        self.deadline = deadline
        self.recompute_on_failure = recompute_on_failure
        self.handle: Any = None
        self.started_at: float | None = None
        self.done_at: float | None = None
        self.error: str | None = None

    def start(self, block_ids: list[int]) -> None:
        transport = self.transport
        assert transport.layout is not None
        self.started_at = time.perf_counter()
        if time.time() >= self.deadline:
            self._fail("its KV expired before the engine could take it")
        try:
            self.handle = transport.post_read(
                self.peer,
                list(self.handoff.block_ids),
                transport._addresses,
                transport.layout,
                block_ids,
                self.handoff.handoff_id,
            )
        except Exception as exc:  # noqa: BLE001 - nixl raises its own backend errors
            self._fail(f"NIXL could not read from {self.peer.name}: {exc!r}")

    def poll(self) -> bool:
        if self.done_at is not None:
            return True
        if self.error is not None:
            raise KVTransferError(self.error)
        state = self.transport.state(self.handle)
        if state == "DONE":
            self.transport.finish(self.handle)
            self.done_at = time.perf_counter()
            return True
        if state != "PROC":
            self._fail(f"the NIXL read from {self.peer.name} failed ({state})")
        if time.time() >= self.deadline:
            self._fail(f"the NIXL read from {self.peer.name} did not finish in time")
        return False

    def abandon(self) -> None:
        """The request went away before its read started: the prefill side may free now."""
        if self.started_at is None:
            self.transport.notify(self.peer, self.handoff.handoff_id)

    def _fail(self, error: str) -> None:
        if self.handle is not None:
            self.transport.finish(self.handle)
            self.handle = None
        self.transport.notify(self.peer, self.handoff.handoff_id)
        self.transport.forget_peer(self.peer.name)
        self.error = error
        raise KVTransferError(error)
