"""The NIXL KV transport: the decode replica reads the prefill replica's cache blocks into its own.

Each engine replica creates one NIXL agent when it starts and registers its whole KV cache
with it (2 regions per layer on huge pages, neuron_runtime/kv_layout.py). The agent has no
progress thread: the decode replica's reader thread drives its reads and the prefill
replica's watch of its holds collects the notifications. What a peer needs to reach that
memory (the agent's metadata: connection details and memory keys; the regions' addresses; the
cache layout) is put into Ray's object store once, and every ticket carries that ref: a decode
replica loads a prefill agent the first time one of its tickets arrives. No socket of ours.

    prefill replica                                   decode replica
    engine: first token out, prompt blocks held
    export: ticket(agent, info ref, handoff id,
            expiry) ----------- router ------------>  receive: load the agent (once), check
                                                       the layouts; equal -> a block read
                                                      engine: allocates the prompt's blocks,
                                                       start(): the reader thread posts the
                                                       READs by index into the prepared lists
                                                      layer-wise: one READ per layer, in layer
                                                       order; the request runs at once, the
                                                       forward waiting for layer i's READ
                                                       before layer i's attention (wait_layer);
                                                       whole: one READ of every layer; the
                                                       request runs once it is done
    notification "handoff id"  <-------------------   (sent once every layer's READ is done)
    release: engine frees the blocks                   poll() -> done

Descriptors are prepared once: at registration every (region, KV head, block) cell of this
replica's cache becomes one entry of a local prepared list, and when a peer is first read
from its cache's cells become a remote one. A READ is then made from two index arrays (the
prompt's blocks, layer by layer); NIXL merges the cells that are adjacent on both sides (a run of
consecutive blocks of one head is one copy). No descriptor is built or validated per request.

Over UCX between two processes of one host (cross-memory attach) a READ copies in the call
that posts it, on the posting thread: so a replica's reads are posted by its reader thread,
and the copy of the later layers runs on another core while the engine computes the first
ones. Where a core and memory bandwidth are free the first decode step then costs about a
colocated one plus the first layer's copy; on a busy two-core host the copy and the step
slow each other down (README: the handoff figures), and waiting for the whole read before the
request's first step is faster. So reads are layer-wise by default where the fabric moves the
bytes (LIBFABRIC: EFA's RDMA) and whole over UCX, whose copies here take a core
(``layer_wise`` overrides either way). The engine's thread never copies.

Delivery (the default in the PD app): the router opens the decode call before the prefill
call. The decode replica ``expect``s the handoff under a key and streams its destination (its
agent and that key) back at once; the router sends the prefill call with it; the prefill
replica exports as above, then sends the handoff itself (this agent's info and the ticket) to
the decode agent as a NIXL notification, loading that agent once. The decode replica's watch
of its notifications hands it to the waiting call, which reads as above. So the handoff does
not travel prefill -> router -> decode: the router holds the first token only until the
decode replica says the blocks are in (deployments/decode.py), and the second token follows
it by one decode step. A handoff that arrives for a call no longer waiting (the client
left, the call timed out) is declined: a notification back frees its blocks on the prefill
replica at once.

    router: decode.generate(await_handoff) -> first step: destination(agent, key)
            prefill.prefill(kv_destination)
    prefill replica: export, then notification "handoff" + (key, handoff) ---> decode agent
    decode replica: the waiting call takes it, reads the blocks, streams kv_arrived as the
                    request's first step starts; the router releases the first token then

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
import pickle
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from deployments.kv_transport import KVTransport, KVTransportError
from deployments.protocol import KVDestination
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
# How often a replica looks for notifications (completions that free held blocks,
# deliveries): every NOTIFY_POLL_MAX_S, and while a decode call waits for a delivery, every
# 1/NOTIFY_POLL_SHARE of the time the oldest such call has waited (NOTIFY_POLL_MIN_S at
# least): the delivery's notice then costs its TTFT under 1/NOTIFY_POLL_SHARE (the first
# token waits for the KV), while a long prefill is not slowed by a poll every millisecond (on
# a two-core host polls that often made a 128-token prefill 9% slower).
NOTIFY_POLL_MIN_S = 0.001
NOTIFY_POLL_MAX_S = 0.01
NOTIFY_POLL_SHARE = 64
# How often the reader thread checks READs that did not complete in the call that posted them.
READ_POLL_S = 0.0002
# Backends whose reads the network adapter performs (no core of either host copies): block
# reads overlap the request's first step by default there.
FABRIC_BACKENDS = ("LIBFABRIC",)
# The longest a forward waits for a read's layers (all its waits together): a read slower
# than this leaves that step without the request, which then waits outside the batch.
JOIN_WAIT_S = 0.25
# Prefill agents a decode replica keeps loaded (the least recently used is dropped).
MAX_PEERS = 64
# A notification that delivers a handoff (others name a handoff whose blocks may be freed).
DELIVERY = b"\x00handoff\x00"
# How long a decode replica keeps watching for deliveries after its last waiting call went:
# one that comes later is declined, freeing the prefill blocks before their hold timeout.
LINGER_S = 5.0


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
    # The prefill agent's NixlAgentInfo: a ray.ObjectRef of it, or (delivered) the info itself.
    agent_info: Any
    expires_at: float  # time.time() at which the prefill replica frees the blocks
    transport: str = "nixl"


class _PeerLink:
    """A loaded agent: its info and, once a block read needs it, its cache's prepared
    descriptor list (a decode agent a prefill replica only notifies needs none). Reads and
    notifications in flight count as users; a link dropped (evicted, or its read failed) is
    released once the last user is done with it."""

    def __init__(self, info: NixlAgentInfo) -> None:
        self.info = info
        self.dlist: Any = None
        self.users = 0
        self.retired = False

    @property
    def name(self) -> str:
        return self.info.name


def cache_cells(addresses: tuple[int, ...], layout: KVLayout) -> np.ndarray:
    """Descriptor rows (address, length, 0) of every (region, KV head, block) cell of a cache,
    in that order: cell (r, h, b) is row ``(r * num_kv_heads + h) * num_blocks + b``."""
    bb = layout.block_bytes
    offsets = np.arange(layout.num_kv_heads * layout.num_blocks, dtype=np.int64) * bb
    starts = np.asarray(addresses, dtype=np.int64)[:, None] + offsets[None, :]
    rows = np.zeros((starts.size, 3), dtype=np.uint64)
    rows[:, 0] = starts.reshape(-1)
    rows[:, 1] = bb
    return rows


def layer_cells(
    layout: KVLayout, num_blocks: int, blocks: list[int] | tuple[int, ...]
) -> np.ndarray:
    """``[num_layers, 2 * num_kv_heads * len(blocks)]`` int32: per layer, the indices into
    ``cache_cells`` (of a cache with ``num_blocks`` blocks) of ``blocks``' cells, K then V,
    head by head, blocks in the given order."""
    regions = np.arange(layout.num_regions, dtype=np.int64).reshape(layout.num_layers, 2, 1, 1)
    heads = np.arange(layout.num_kv_heads, dtype=np.int64).reshape(1, 1, -1, 1)
    ids = np.asarray(blocks, dtype=np.int64).reshape(1, 1, 1, -1)
    cells = (regions * layout.num_kv_heads + heads) * num_blocks + ids
    return cells.reshape(layout.num_layers, -1).astype(np.int32)


class NixlTransport(KVTransport):
    """One replica's NIXL agent: its cache registered, peers loaded on demand."""

    name = "nixl"

    def __init__(
        self,
        backend: str = "UCX",
        hold_timeout_s: float = 30.0,
        publish: Callable[[NixlAgentInfo], Any] | None = None,
        layer_wise: bool | None = None,
    ) -> None:
        """``publish``: makes this agent's info reachable by peers and returns the awaitable
        reference that tickets carry (default ``ray.put``). ``layer_wise``: whether this
        replica's block reads overlap the request's first step layer by layer (None: by
        backend, see the module's docstring)."""
        self.backend = backend
        self.hold_timeout_s = hold_timeout_s
        self.layer_wise = backend in FABRIC_BACKENDS if layer_wise is None else layer_wise
        self.publish = publish
        self.agent: Any = None
        self.info: NixlAgentInfo | None = None
        self.info_ref: Any = None
        self.layout: KVLayout | None = None
        self._addresses: tuple[int, ...] = ()
        self._held: dict[str, float] = {}  # handoff id -> expiry (prefill side)
        self._inbox: dict[str, asyncio.Future[KVHandoff]] = {}  # key -> delivery (decode side)
        self._expected_at: dict[str, float] = {}  # key -> when its call began waiting
        self._watch_until = 0.0  # time.monotonic(): watch for deliveries until then at least
        self._watch_task: asyncio.Task | None = None
        self._declines: set[asyncio.Task] = set()
        self._peers: OrderedDict[str, _PeerLink] = OrderedDict()  # decode side
        self._retired: dict[str, _PeerLink] = {}  # dropped, with reads still using them
        self._peers_lock = threading.Lock()
        self._local_dlist: Any = None  # this cache's cells, prepared (cache_cells)
        self.reader = _Reader()  # decode side

    def attach(self, engine: Any, release: Any) -> None:
        """Creates the agent and registers the engine's whole KV cache with it, once."""
        super().attach(engine, release)
        kv_caches = engine.runner.kv_caches
        self.layout = cache_layout(kv_caches)
        name = f"neuron-kv-{uuid.uuid4().hex[:12]}"
        # No progress thread: NIXL's polls without pause and takes a whole core per replica
        # (two of this box's two with a prefill and a decode replica). Reads progress where
        # they are polled (the decode engine's step), notifications where they are collected
        # (_watch_notifications).
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
        self._local_dlist = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", cache_cells(self._addresses, self.layout), "DRAM"
        )
        info = self.info = NixlAgentInfo(
            name, agent.get_agent_metadata(), self._addresses, self.layout
        )
        if self.publish is None:
            import ray

            self.info_ref = ray.put(info)
        else:
            self.info_ref = self.publish(info)

    # -- prefill side ------------------------------------------------------------------------

    def export(self, handoff: KVHandoff) -> KVHandoff:
        expires_at = time.time() + self.hold_timeout_s
        self._held[handoff.handoff_id] = expires_at
        self._watch()
        ticket = NixlTicket(self.agent.name, self.info_ref, expires_at)
        return dataclasses.replace(handoff, ticket=ticket)

    def num_held(self) -> int:
        return len(self._held)

    async def deliver(self, handoff: KVHandoff, destination: KVDestination) -> None:
        """Sends an exported handoff, with this agent's info in its ticket, to the decode
        agent waiting for it (loaded once): one notification."""
        ticket = handoff.ticket
        assert isinstance(ticket, NixlTicket) and self.info is not None
        try:
            link = await self._peer(
                destination.agent_name, destination.agent_info, ticket.expires_at - EXPIRY_MARGIN_S
            )
        except asyncio.CancelledError:
            self._free(handoff.handoff_id)  # never sent, and the caller is gone
            raise
        except Exception as exc:  # noqa: BLE001 - its owner died, late, unreachable
            raise KVTransportError(
                f"decode agent {destination.agent_name} cannot be reached: {exc!r}"
            ) from exc
        try:
            own = dataclasses.replace(ticket, agent_info=self.info)
            sent = dataclasses.replace(handoff, ticket=own)
            self.agent.send_notif(link.name, DELIVERY + pickle.dumps((destination.key, sent)))
        except Exception as exc:  # noqa: BLE001 - nixl raises its own backend errors
            self.forget_peer(link.name)
            raise KVTransportError(f"the handoff could not be sent to {link.name}: {exc}") from exc
        finally:
            self.unuse(link)

    def _watch(self) -> None:
        """Starts the watch of this agent's notifications unless it runs."""
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.get_running_loop().create_task(self._watch_notifications())

    async def _watch_notifications(self) -> None:
        """Prefill side: frees held blocks on each completion notification, or at expiry.
        Decode side: hands each delivered handoff to the call waiting for it, or declines it."""
        while self._held or self._inbox or time.monotonic() < self._watch_until:
            for messages in self.agent.get_new_notifs().values():
                for message in messages:
                    if message.startswith(DELIVERY):
                        self._arrived(message[len(DELIVERY) :])
                    else:
                        self._free(message.decode())
            now = time.time()
            for handoff_id in [h for h, expiry in self._held.items() if expiry <= now]:
                logger.warning("KV of %s was not read in time: freeing its blocks", handoff_id)
                self._free(handoff_id)
            await asyncio.sleep(self._poll_interval())

    def _poll_interval(self) -> float:
        if not self._expected_at:
            return NOTIFY_POLL_MAX_S
        waited = time.monotonic() - min(self._expected_at.values())
        return min(NOTIFY_POLL_MAX_S, max(NOTIFY_POLL_MIN_S, waited / NOTIFY_POLL_SHARE))

    def _free(self, handoff_id: str) -> None:
        if self._held.pop(handoff_id, None) is not None:
            self.release(handoff_id)

    # -- decode side -------------------------------------------------------------------------

    def expect(self, key: str) -> KVDestination:
        if key in self._inbox:
            raise ValueError(f"a handoff is already expected under {key!r}")
        self._inbox[key] = asyncio.get_running_loop().create_future()
        self._expected_at[key] = time.monotonic()
        self._watch()
        return KVDestination(self.agent.name, self.info_ref, key)

    async def wait(self, key: str, timeout_s: float) -> KVHandoff:
        handoff = await asyncio.wait_for(asyncio.shield(self._inbox[key]), timeout_s)
        del self._inbox[key]
        del self._expected_at[key]
        return handoff

    def forget(self, key: str) -> None:
        arrival = self._inbox.pop(key, None)
        self._expected_at.pop(key, None)
        if arrival is None:
            return
        self._watch_until = time.monotonic() + LINGER_S
        if arrival.done():
            self._decline(arrival.result())
        else:
            arrival.cancel()

    def _arrived(self, data: bytes) -> None:
        try:
            key, handoff = pickle.loads(data)
        except Exception:  # noqa: BLE001 - not one of ours; the watch goes on
            logger.exception("a NIXL notification that is not a handoff was dropped")
            return
        arrival = self._inbox.get(key)
        if arrival is None or arrival.done():
            self._decline(handoff)
        else:
            arrival.set_result(handoff)

    def _decline(self, handoff: KVHandoff) -> None:
        """Tells the prefill replica that a delivered handoff will not be read."""

        async def decline() -> None:
            ticket = handoff.ticket
            with contextlib.suppress(Exception):  # else its hold timeout frees the blocks
                link = await self._peer(ticket.agent_name, ticket.agent_info, ticket.expires_at)
                self.notify(link, handoff.handoff_id)
                self.unuse(link)

        task = asyncio.get_running_loop().create_task(decline())
        self._declines.add(task)
        task.add_done_callback(self._declines.discard)

    async def receive(self, handoff: KVHandoff, timeout_s: float) -> KVImport:
        ticket = handoff.ticket
        if not isinstance(ticket, NixlTicket):
            raise KVTransportError(f"a nixl replica was given {ticket!r}")
        assert self.layout is not None and handoff.layout is not None
        deadline = min(time.time() + timeout_s, ticket.expires_at - EXPIRY_MARGIN_S)
        if time.time() >= deadline:
            raise KVTransportError(f"the KV of {handoff.handoff_id} expires too soon to read")
        link = await self._peer(ticket.agent_name, ticket.agent_info, deadline)
        mismatch = self.layout.mismatch(handoff.layout)
        if mismatch is None:
            with self._peers_lock:  # the peer's cells, prepared once for block reads
                if link.dlist is None:
                    cells = cache_cells(link.info.region_addresses, link.info.layout)
                    link.dlist = self.agent.prep_xfer_dlist(link.name, cells, "DRAM")
            return NixlBlockRead(self, link, handoff, deadline)  # the read holds the link
        try:
            logger.info(
                "KV of %s: cache layouts differ (%s); reading it as tokens",
                handoff.handoff_id,
                mismatch,
            )
            return await self._read_tokens(link, handoff, deadline)
        finally:
            self.unuse(link)

    async def _peer(self, name: str, agent_info: Any, deadline: float) -> _PeerLink:
        """The agent ``name``, loaded (once, from ``agent_info``: its NixlAgentInfo or an
        ObjectRef of it) and counted as used until ``unuse``."""
        with self._peers_lock:
            link = self._peers.get(name) or self._retired.pop(name, None)
            if link is not None:
                link.retired = False
                self._peers[link.name] = link
                self._peers.move_to_end(link.name)
                link.users += 1
                return link
        info = agent_info
        if not isinstance(info, NixlAgentInfo):
            info = await asyncio.wait_for(agent_info, max(0.0, deadline - time.time()))
        assert isinstance(info, NixlAgentInfo) and info.name == name
        with self._peers_lock:
            link = self._peers.get(info.name)
            if link is not None:  # loaded meanwhile by another request
                link.users += 1
                return link
            self.agent.add_remote_agent(info.metadata)
            link = _PeerLink(info)
            link.users += 1
            self._peers[info.name] = link
            while len(self._peers) > MAX_PEERS:
                self._retire(next(iter(self._peers)))
        # Connect now rather than on the first READ (tens of ms here), off the event loop.
        await asyncio.to_thread(self.agent.make_connection, info.name)
        return link

    def unuse(self, link: _PeerLink) -> None:
        """A read is done with ``link``; a dropped link is released with its last user."""
        with self._peers_lock:
            link.users -= 1
            if link.retired and link.users <= 0 and self._retired.get(link.name) is link:
                del self._retired[link.name]
                self._drop(link)

    def _retire(self, name: str) -> None:
        """Drops a loaded peer (the caller holds the lock); released now or by its last user."""
        link = self._peers.pop(name, None)
        if link is None:
            return
        link.retired = True
        if link.users <= 0:
            self._drop(link)
        else:
            self._retired[name] = link

    def _drop(self, link: _PeerLink) -> None:
        if link.dlist is not None:
            with contextlib.suppress(Exception):
                self.agent.release_dlist_handle(link.dlist)
        with contextlib.suppress(Exception):
            self.agent.remove_remote_agent(link.name)

    def notify(self, link: _PeerLink, handoff_id: str) -> None:
        """Tells a prefill replica to free a handoff's blocks now (best effort)."""
        with contextlib.suppress(Exception):
            self.agent.send_notif(link.name, handoff_id.encode())

    def forget_peer(self, name: str) -> None:
        """Drops a peer whose transfer failed: it may be gone; a later ticket loads it again."""
        with self._peers_lock:
            self._retire(name)

    def post(self, link: _PeerLink, local: np.ndarray, remote: np.ndarray) -> Any:
        """One READ of the peer's cells ``remote`` into this cache's cells ``local`` (indices
        into the prepared lists, cache_cells); its handle. Over UCX between processes of one
        host the copy happens here."""
        handle = self.agent.make_prepped_xfer("READ", self._local_dlist, local, link.dlist, remote)
        if self.agent.transfer(handle) == "ERR":
            self.finish(handle)
            raise KVTransferError(f"NIXL could not post the read from {link.name}")
        return handle

    def state(self, handle: Any) -> str:
        return self.agent.check_xfer_state(handle)

    def finish(self, handle: Any) -> None:
        """Releases a transfer handle (cancelling the transfer if it is still running)."""
        with contextlib.suppress(Exception):
            self.agent.release_xfer_handle(handle)

    async def _read_tokens(self, link: _PeerLink, handoff: KVHandoff, deadline: float) -> KVPayload:
        """The fallback for caches of another layout: the prefill blocks into a staging buffer
        laid out like a cache of theirs, then the tokens as a payload."""
        src = link.info.layout
        num_blocks = len(handoff.block_ids)
        shape = (src.num_regions, src.num_kv_heads, num_blocks, src.block_size, src.head_dim)
        stage = torch.empty(shape)
        registration = self.agent.register_memory([stage])
        try:
            addresses = tuple(stage[r].data_ptr() for r in range(src.num_regions))
            src_rows, dst_rows = read_descriptors(
                dataclasses.replace(src, num_blocks=num_blocks),
                link.info.region_addresses,
                src.num_blocks,
                list(handoff.block_ids),
                addresses,
                list(range(num_blocks)),
            )

            def post() -> Any:
                local = self.agent.get_xfer_descs(dst_rows, "DRAM")
                remote = self.agent.get_xfer_descs(src_rows, "DRAM")
                notification = handoff.handoff_id.encode()
                handle = self.agent.initialize_xfer("READ", local, remote, link.name, notification)
                if self.agent.transfer(handle) == "ERR":
                    self.finish(handle)
                    raise KVTransferError(f"NIXL could not post the read from {link.name}")
                return handle

            handle = await asyncio.to_thread(post)
            try:
                while (state := self.state(handle)) == "PROC" and time.time() < deadline:
                    await asyncio.sleep(0.0005)
            finally:
                self.finish(handle)
        finally:
            self.agent.deregister_memory(registration)
        if state != "DONE":
            self.forget_peer(link.name)
            raise KVTransportError(f"NIXL read of {handoff.handoff_id} ended {state}")
        num_tokens = handoff.metadata.num_tokens
        # [2L, kvh, blocks, bs, d] -> [L, 2, kvh, tokens, d] -> [2, L, kvh, tokens, d]
        tokens = stage.view(src.num_layers, 2, src.num_kv_heads, -1, src.head_dim)
        kv = tokens[:, :, :, :num_tokens].transpose(0, 1).contiguous().numpy()
        return KVPayload(handoff.metadata, kv)

    def close(self) -> None:
        self.reader.close()
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self.agent is not None:
            with self._peers_lock:
                for link in [*self._peers.values(), *self._retired.values()]:
                    self._drop(link)
                self._peers.clear()
                self._retired.clear()
            with contextlib.suppress(Exception):
                self.agent.release_dlist_handle(self._local_dlist)
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(self._registration)
            self.agent = None


class NixlBlockRead(KVBlockSource):
    """One handed-off prompt read into the decode engine's cache.

    ``start`` (the engine's loop thread) queues it on the transport's reader thread, which
    posts the READs (``run``): one per layer in layer order when the read is layer-wise, else
    one of every layer's cells (the request waits for the whole read anyway, and one posting
    call costs less than one per layer), and counts the layers in as their READs complete.
    ``wait_layer`` (the engine's forward, before a layer's attention) and ``poll`` read that
    count. The timings are read by the decode replica for its transfer metrics
    (``started_at``, ``done_at``) and by bench/kv_handoff.py (``picked_at``: the reader thread
    took it; ``post_s``: time in the posting calls, where the copy happens).

    The read uses its peer's link from ``receive`` until its reader thread is done with it, or
    until ``abandon`` if it never started.
    """

    def __init__(
        self,
        transport: NixlTransport,
        link: _PeerLink,
        handoff: KVHandoff,
        deadline: float,
        recompute_on_failure: bool = True,
    ) -> None:
        assert handoff.layout is not None
        self.transport = transport
        self.link = link
        self.handoff = handoff
        self.metadata = handoff.metadata
        self.layout = handoff.layout
        self.deadline = deadline
        self.recompute_on_failure = recompute_on_failure
        self.layer_wise = transport.layer_wise
        self.block_ids: list[int] = []
        self.started_at: float | None = None
        self.picked_at: float | None = None
        self.done_at: float | None = None
        self.post_s = 0.0
        self.error: str | None = None
        self._link_held = True
        self._progress = threading.Condition()
        self._layers_in = 0  # layers 0 .. _layers_in - 1 are all in
        self._ended = False  # the reader thread is done with it: all in, or failed
        self._join_by: float | None = None  # time.monotonic() bound of wait_layer

    def start(self, block_ids: list[int]) -> None:
        self.started_at = time.perf_counter()
        self.block_ids = list(block_ids)
        self.transport.reader.submit(self)

    def poll(self) -> bool:
        if self.done_at is not None:
            return True  # every layer's READ is done (the reader thread may still be tidying)
        if self.error is not None:
            raise KVTransferError(self.error)
        return False

    def wait_layer(self, layer: int) -> bool:
        """Blocks until ``layer``'s blocks are in; False if the read failed or is slower than
        JOIN_WAIT_S (from the first wait) or its deadline: the caller then drops the step's
        output for this request, whose blocks the read may still be writing."""
        with self._progress:
            if self._join_by is None:
                self._join_by = time.monotonic() + JOIN_WAIT_S
            timeout = min(self._join_by - time.monotonic(), self.deadline - time.time())
            self._progress.wait_for(
                lambda: self._layers_in > layer or self._ended, max(0.0, timeout)
            )
            return self._layers_in > layer and self.error is None

    def abandon(self) -> None:
        """The request went away before its read started: the prefill side may free now."""
        if self.started_at is None:
            self.transport.notify(self.link, self.handoff.handoff_id)
            self._let_go()

    def _let_go(self) -> None:
        with self._progress:
            held, self._link_held = self._link_held, False
        if held:
            self.transport.unuse(self.link)

    def run(self) -> None:
        """The reader thread's part: the READs posted in layer order, then waited for."""
        self.picked_at = time.perf_counter()
        transport = self.transport
        assert transport.layout is not None
        handles: list[Any] = []
        error = None
        try:
            if time.time() >= self.deadline:
                raise KVTransferError("its KV expired before the engine could take it")
            local = layer_cells(transport.layout, transport.layout.num_blocks, self.block_ids)
            remote = layer_cells(
                self.layout, self.link.info.layout.num_blocks, self.handoff.block_ids
            )
            num_layers = self.layout.num_layers
            if not self.layer_wise:  # one READ of every layer's cells, layer after layer
                local, remote = local.reshape(1, -1), remote.reshape(1, -1)
            for layers_local, layers_remote in zip(local, remote, strict=True):
                before = time.perf_counter()
                handles.append(transport.post(self.link, layers_local, layers_remote))
                self.post_s += time.perf_counter() - before
                self._count_layers_in(handles)
            while self._count_layers_in(handles) < num_layers:
                if time.time() >= self.deadline:
                    raise KVTransferError("it did not finish in time")
                time.sleep(READ_POLL_S)
        except Exception as exc:  # noqa: BLE001 - nixl raises its own backend errors
            error = f"the NIXL read from {self.link.name} failed: {exc}"
        finally:
            for handle in handles:  # cancels the READs still running
                transport.finish(handle)
            # Only now may the prefill side free (and reuse) the blocks read from, and the
            # engine its own (poll raises once ``error`` is set).
            transport.notify(self.link, self.handoff.handoff_id)
            if error is not None:
                transport.forget_peer(self.link.name)
            self._let_go()
            with self._progress:
                self.error = error
                self._ended = True
                self._progress.notify_all()

    def _count_layers_in(self, handles: list[Any]) -> int:
        """Advances the count of leading layers whose READ is done (each handle covers the
        same number of layers: one, or all); raises on a failed READ."""
        num_layers = self.layout.num_layers
        per_handle = 1 if self.layer_wise else num_layers
        done = self._layers_in // per_handle
        while done < len(handles):
            state = self.transport.state(handles[done])
            if state == "PROC":
                break
            if state != "DONE":
                raise KVTransferError(f"READ {done} of the prompt's KV ended {state}")
            done += 1
        count = done * per_handle
        if count > self._layers_in:
            with self._progress:
                if count == num_layers:
                    self.done_at = time.perf_counter()
                self._layers_in = count
                self._progress.notify_all()
        return count


class _Reader:
    """A transport's reader thread: posts and waits for block reads, one after another.

    A READ over UCX's cross-memory attach copies in the call that posts it (NIXL releases the
    GIL there), so posting off the engine's thread is what lets the copy overlap its compute.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[NixlBlockRead | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, read: NixlBlockRead) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nixl-reader", daemon=True)
                self._thread.start()
        self._queue.put(read)

    def _run(self) -> None:
        while (read := self._queue.get()) is not None:
            read.run()

    def close(self) -> None:
        with self._lock:
            if self._thread is not None:
                self._queue.put(None)
