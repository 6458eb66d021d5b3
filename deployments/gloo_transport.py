"""The gloo KV transport: torch.distributed point-to-point between a prefill and a decode replica.

Gloo is the CPU stand-in for Neuron collectives: the same ``send``/``recv`` on a process group,
so the serving path keeps its shape when the backend changes. No default process group
(``init_process_group`` allows one per process, and a replica talks to many peers): each
transfer gets its own two-rank ProcessGroupGloo, rendezvoused through a PrefixStore on the
prefill replica's TCPStore.

    prefill replica                                    decode replica
    export: outbox[transfer_id] = payload
            ticket(127.0.0.1, port, transfer_id, metadata) --- router --->
    dispatcher thread: queue_pop("kv/requests")  <---  TCPStore client: queue_push(request)
    sender thread: pair group rank 0                   pair group rank 1 (PrefixStore session/)
            send header [found]  ------------------->  recv header; missing -> raise
            send kv  ------------------------------->  recv into empty(metadata.shape)
            delete the session's store keys

A transfer is taken from the outbox when asked for (one fetch per ticket). Entries nobody asks
for expire, so a request aborted between prefill and decode strands nothing. Every blocking
step has a deadline: the fetch's own timeout on the decode side, and the timeout the decode
side sent along with its request on the prefill side. Every socket is on 127.0.0.1: the
TCPStore listens on a socket bound here, and gloo's device is created for 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from torch.distributed import DistError, PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo

from deployments.kv_transport import GlooTicket, KVTicket, KVTransport, KVTransportError
from neuron_runtime.kv_transfer import KVPayload

logger = logging.getLogger("ray.serve")

HOST = "127.0.0.1"
REQUESTS_KEY = "kv/requests"
STOP = "stop"
# The dispatcher's wait for the next request; it wakes early for every request and on close.
DISPATCH_WAIT = timedelta(hours=1)
# Decode-side threads doing blocking receives; each ends by its fetch's deadline.
MAX_CONCURRENT_FETCHES = 8


@functools.cache
def _loopback_device() -> Any:
    # One gloo device (listener + event loop thread) per process, shared by every pair group:
    # creating it per transfer took ~8 of a group's ~18 ms setup here.
    return ProcessGroupGloo.create_device(hostname=HOST)


def pair_group(store: TCPStore, session: str, rank: int, timeout_s: float) -> ProcessGroupGloo:
    """A two-rank gloo group for one transfer: rank 0 sends, rank 1 receives."""
    options = ProcessGroupGloo._Options()
    options._devices = [_loopback_device()]
    options._timeout = timedelta(seconds=timeout_s)
    return ProcessGroupGloo(PrefixStore(f"kv/{session}", store), rank, 2, options)


class Outbox:
    """Exported payloads waiting for their decode replica, oldest first; thread-safe.

    Bounded in bytes: a new payload drops the oldest until it fits (a payload larger than the
    whole bound is kept alone), and the dropped request's decode replica recomputes or fails.
    """

    def __init__(self, timeout_s: float, max_bytes: int) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, tuple[float, KVPayload]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, payload: KVPayload) -> str:
        transfer_id = uuid.uuid4().hex
        with self._lock:
            self._expire()
            while self._entries and self.nbytes + payload.nbytes > self.max_bytes:
                dropped = self._pop_oldest()
                logger.warning("KV outbox full: dropped transfer %s", dropped)
            self._entries[transfer_id] = (time.monotonic() + self.timeout_s, payload)
            self.nbytes += payload.nbytes
        return transfer_id

    def take(self, transfer_id: str) -> KVPayload | None:
        """The payload, removed; None when it expired, was dropped or was already taken."""
        with self._lock:
            self._expire()
            entry = self._entries.pop(transfer_id, None)
            if entry is None:
                return None
            self.nbytes -= entry[1].nbytes
            return entry[1]

    def expire(self) -> None:
        with self._lock:
            self._expire()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def _expire(self) -> None:
        now = time.monotonic()
        # Insertion order is expiry order: every entry lives timeout_s.
        while self._entries and next(iter(self._entries.values()))[0] <= now:
            self._pop_oldest()

    def _pop_oldest(self) -> str:
        transfer_id, (_, payload) = self._entries.popitem(last=False)
        self.nbytes -= payload.nbytes
        return transfer_id


class GlooServer:
    """The prefill replica's side: a TCPStore on 127.0.0.1 and a thread answering requests."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        # Our own listening socket: TCPStore's would listen on every interface. The store
        # owns the descriptor from here on and closes it when it is destroyed.
        listener = socket.create_server((HOST, 0), backlog=128)
        self.port: int = listener.getsockname()[1]
        self._store: TCPStore | None = TCPStore(
            HOST,
            self.port,
            None,
            True,
            timedelta(seconds=30),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._dispatch, name="kv-gloo-dispatch", daemon=True)
        self._thread.start()
        # Expired payloads are freed on time even when no export, fetch or stats call comes.
        threading.Thread(target=self._expire_loop, name="kv-gloo-expire", daemon=True).start()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        assert self._store is not None
        self._store.queue_push(REQUESTS_KEY, STOP)
        self._thread.join(timeout=5)
        self._store = None  # stops the store's server and closes its socket

    def _client(self, timeout: timedelta) -> TCPStore:
        # One connection per thread: a blocking store call holds its connection.
        return TCPStore(HOST, self.port, None, False, timeout)

    def _expire_loop(self) -> None:
        period = min(1.0, self.outbox.timeout_s / 2)
        while not self._closed.wait(period):
            self.outbox.expire()

    def _dispatch(self) -> None:
        store = self._client(DISPATCH_WAIT)
        while not self._closed.is_set():
            try:
                raw = store.queue_pop(REQUESTS_KEY).decode()
            except DistError as exc:
                # No request within DISPATCH_WAIT, or the connection broke: never spin.
                logger.debug("KV dispatcher: %r", exc)
                time.sleep(0.1)
                continue
            if raw == STOP:
                return
            try:
                request: dict[str, Any] = json.loads(raw)
                session, transfer_id = str(request["session"]), str(request["transfer_id"])
                timeout_s = min(float(request["timeout_s"]), self.outbox.timeout_s)
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("KV dispatcher: malformed request %.200r: %r", raw, exc)
                continue
            payload = self.outbox.take(transfer_id)
            threading.Thread(
                target=self._send,
                args=(session, payload, timeout_s),
                name="kv-gloo-send",
                daemon=True,
            ).start()

    def _send(self, session: str, payload: KVPayload | None, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        store = self._client(timeout)
        group = None
        try:
            group = pair_group(store, session, 0, timeout_s)
            header = torch.tensor([payload is not None], dtype=torch.int64)
            group.send([header], 1, 0).wait(timeout)
            if payload is not None:
                kv = torch.from_numpy(np.ascontiguousarray(payload.kv))
                group.send([kv], 1, 1).wait(timeout)
        except RuntimeError as exc:  # the decode replica left or gave up: it recomputes or fails
            logger.warning("KV send for session %s failed: %r", session, exc)
        finally:
            if group is not None:
                group.shutdown()
            self._delete_keys(store, f"kv/{session}/")

    @staticmethod
    def _delete_keys(store: TCPStore, prefix: str) -> None:
        try:
            for key in store.list_keys():
                if key.startswith(prefix):
                    store.delete_key(key)
        except DistError:  # the store closed with its replica: the keys went with it
            pass


def receive(ticket: GlooTicket, deadline: float) -> KVPayload:
    """Decode side, blocking: asks the ticket's prefill replica for the payload and receives it.

    Raises KVTransportError when the payload is not there, the peer does not answer, or the
    deadline (time.monotonic()) passes.
    """

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVTransportError(f"KV transfer {ticket.transfer_id} timed out")
        return left

    session = uuid.uuid4().hex
    try:
        store = TCPStore(ticket.host, ticket.port, None, False, timedelta(seconds=remaining()))
        request = {"session": session, "transfer_id": ticket.transfer_id, "timeout_s": remaining()}
        store.queue_push(REQUESTS_KEY, json.dumps(request))
        timeout_s = remaining()
        group = pair_group(store, session, 1, timeout_s)
        try:
            header = torch.zeros(1, dtype=torch.int64)
            group.recv([header], 0, 0).wait(timedelta(seconds=remaining()))
            if not header.item():
                raise KVTransportError(
                    f"the prefill replica at {ticket.host}:{ticket.port} has no KV transfer "
                    f"{ticket.transfer_id} (expired, dropped or already taken)"
                )
            kv = torch.empty(ticket.metadata.shape, dtype=torch.float32)
            group.recv([kv], 0, 1).wait(timedelta(seconds=remaining()))
        finally:
            group.shutdown()
    except KVTransportError:
        raise
    except RuntimeError as exc:  # DistError and gloo's own timeouts and connection errors
        raise KVTransportError(f"KV transfer {ticket.transfer_id} failed: {exc}") from exc
    return KVPayload(ticket.metadata, kv.numpy())


class GlooTransport(KVTransport):
    """Prefill side: an outbox served by a GlooServer (started on the first export).
    Decode side: receives on a small thread pool so the replica's event loop never blocks."""

    name = "gloo"

    def __init__(self, outbox_timeout_s: float, outbox_max_bytes: int) -> None:
        self.outbox = Outbox(outbox_timeout_s, outbox_max_bytes)
        self._server: GlooServer | None = None
        self._server_lock = threading.Lock()
        self._receivers = ThreadPoolExecutor(MAX_CONCURRENT_FETCHES, "kv-gloo-recv")

    def export(self, payload: KVPayload) -> KVTicket:
        with self._server_lock:
            if self._server is None:
                self._server = GlooServer(self.outbox)
            port = self._server.port
        transfer_id = self.outbox.put(payload)
        return GlooTicket(HOST, port, transfer_id, payload.metadata)

    async def fetch(self, ticket: KVTicket, timeout_s: float) -> KVPayload:
        if not isinstance(ticket, GlooTicket):
            raise KVTransportError(f"a gloo replica was given a {ticket.transport} ticket")
        deadline = time.monotonic() + timeout_s
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._receivers, receive, ticket, deadline)
        # Cancelling abandons the thread, which ends by the deadline on its own.
        return await asyncio.wait_for(future, timeout_s)

    def num_outbox(self) -> int:
        return len(self.outbox)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._receivers.shutdown(wait=False, cancel_futures=True)
