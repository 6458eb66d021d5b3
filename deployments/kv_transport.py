"""How a prefilled request's KV travels from a prefill replica to a decode replica.

A transport has two halves. ``export`` runs on the prefill replica and returns a ticket: plain
data that rides in PrefillResult -> DecodeRequest through the router. ``fetch`` runs on the
decode replica, redeems the ticket within a timeout and returns the KVPayload, or raises
(the decode replica then applies its policy: recompute or fail). Two implementations, chosen
by name in the config (``DisaggregationArgs.kv_transport``):

- ``object_store``: the payload goes into Ray's object store (``ray.put``); the ticket holds
  the ObjectRef, and the payload lives as long as someone holds it.
- ``gloo``: the prefill replica keeps the payload in an outbox and sends it over a
  torch.distributed gloo pair group when a decode replica asks (deployments/gloo_transport.py).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

import ray

from neuron_runtime.kv_transfer import KVMetadata, KVPayload

TransportName = Literal["object_store", "gloo"]


class KVTransportError(RuntimeError):
    """A ticket could not be redeemed: the payload is gone, late, or the peer is unreachable."""


@dataclass(frozen=True)
class KVTransportConfig:
    """Which transport the prefill and decode replicas of one application use.

    The outbox settings apply to transports that keep payloads on the prefill replica until
    asked (gloo): entries nobody redeems within ``outbox_timeout_s`` are dropped, and they hold
    at most ``outbox_max_bytes`` (the oldest is dropped first).
    """

    name: TransportName = "object_store"
    outbox_timeout_s: float = 60.0
    outbox_max_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.name not in ("object_store", "gloo"):
            raise ValueError(f"unknown KV transport {self.name!r}: 'object_store' or 'gloo'")
        if self.outbox_timeout_s <= 0:
            raise ValueError(f"outbox_timeout_s must be > 0, got {self.outbox_timeout_s}")
        if self.outbox_max_bytes < 1:
            raise ValueError(f"outbox_max_bytes must be >= 1, got {self.outbox_max_bytes}")


@dataclass(frozen=True)
class ObjectStoreTicket:
    """A payload in Ray's object store, alive while this reference is."""

    ref: Any  # ray.ObjectRef of a KVPayload
    transport: str = "object_store"


@dataclass(frozen=True)
class GlooTicket:
    """A payload in a prefill replica's outbox, sent by its gloo server at (host, port).

    The metadata travels here, so the receiver allocates the array before the bytes arrive.
    """

    host: str
    port: int
    transfer_id: str
    metadata: KVMetadata
    transport: str = "gloo"


KVTicket = ObjectStoreTicket | GlooTicket


class KVTransport(ABC):
    """One half or both of a transport; each replica builds its own from the config."""

    name: str

    @abstractmethod
    def export(self, payload: KVPayload) -> KVTicket:
        """Prefill side: makes the payload available and returns the ticket that names it."""

    @abstractmethod
    async def fetch(self, ticket: KVTicket, timeout_s: float) -> KVPayload:
        """Decode side: the payload within ``timeout_s``, or KVTransportError / TimeoutError."""

    def num_outbox(self) -> int:
        """Payloads this replica holds for decode replicas that have not asked yet."""
        return 0

    @abstractmethod
    def close(self) -> None:
        """Releases listeners and threads; the replica is going away."""


class ObjectStoreTransport(KVTransport):
    """Ray's object store: numpy is read zero-copy; the owner (prefill replica) keeps it."""

    name = "object_store"

    def export(self, payload: KVPayload) -> KVTicket:
        return ObjectStoreTicket(ray.put(payload))

    async def fetch(self, ticket: KVTicket, timeout_s: float) -> KVPayload:
        if not isinstance(ticket, ObjectStoreTicket):
            raise KVTransportError(f"an object_store replica was given a {ticket.transport} ticket")
        payload = await asyncio.wait_for(ticket.ref, timeout_s)
        assert isinstance(payload, KVPayload), type(payload)
        return payload

    def close(self) -> None:
        """Nothing to release: Ray frees each payload when its last reference goes."""


def make_transport(config: KVTransportConfig) -> KVTransport:
    """The transport the config names; gloo's module (torch.distributed) loads only here."""
    if config.name == "gloo":
        from deployments.gloo_transport import GlooTransport

        return GlooTransport(config.outbox_timeout_s, config.outbox_max_bytes)
    return ObjectStoreTransport()
