"""How a prefilled request's KV travels from a prefill replica to a decode replica.

The prefill engine hands a request off as a ``KVHandoff`` (neuron_runtime/kv_transfer.py): the
prompt's blocks stay held in its cache. A transport has two halves. ``export`` runs on the
prefill replica and puts the transport's plain-data ticket into the handoff, which rides
PrefillResult -> router -> DecodeRequest unchanged. ``receive`` runs on the decode replica and,
within a timeout, turns the handoff into what the decode engine imports (``handoff.kv``), or
raises (the decode replica then applies its policy: recompute or fail). Two implementations,
chosen by name in the config (``DisaggregationArgs.kv_transport``):

- ``nixl`` (deployments/nixl_transport.py): each engine replica registers its KV cache with a
  NIXL agent; the decode engine allocates its blocks and reads the prefill blocks straight into
  them (one READ), whose completion notifies the prefill replica to free them.
- ``object_store``: the prefill replica copies the prompt's KV out of its blocks (freeing them
  at once) and ``ray.put``s the array; the ticket holds the ObjectRef.

Either way the prefill replica never holds a handed-off prompt's blocks longer than
``hold_timeout_s``.

NIXL can also deliver: the PD router opens the decode call first, the decode replica
``expect``s the handoff under a key and names its ``destination``, and the prefill replica
``deliver``s the exported handoff there itself (a NIXL notification), so the handoff does not
travel prefill -> router -> decode on the second token's path.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import ray

from deployments.protocol import KVDestination
from neuron_runtime.engine import LLMEngine
from neuron_runtime.kv_transfer import KVHandoff, KVImport, KVPayload

TransportName = Literal["nixl", "object_store"]


class KVTransportError(RuntimeError):
    """A ticket could not be redeemed: the KV is gone, late, or the peer is unreachable."""


@dataclass(frozen=True)
class KVTransportConfig:
    """Which transport the prefill and decode replicas of one application use.

    ``hold_timeout_s``: the longest a prefill replica holds a handed-off prompt's blocks for a
    decode replica to read (nixl); a read that has not finished by then is abandoned.
    ``nixl_backend``: the NIXL backend plugin (UCX here; LIBFABRIC for EFA on Trainium).
    ``nixl_layer_wise``: block reads overlapped with the request's first step layer by layer
    (True) or waited for whole (False); None: by backend (deployments/nixl_transport.py).
    """

    name: TransportName = "nixl"
    hold_timeout_s: float = 30.0
    nixl_backend: str = "UCX"
    nixl_layer_wise: bool | None = None

    def __post_init__(self) -> None:
        if self.name not in ("nixl", "object_store"):
            raise ValueError(f"unknown KV transport {self.name!r}: 'nixl' or 'object_store'")
        if self.hold_timeout_s <= 0:
            raise ValueError(f"hold_timeout_s must be > 0, got {self.hold_timeout_s}")
        if not self.nixl_backend:
            raise ValueError("nixl_backend must name a NIXL backend plugin, e.g. 'UCX'")


@dataclass(frozen=True)
class ObjectStoreTicket:
    """A payload in Ray's object store, alive while this reference is."""

    ref: Any  # ray.ObjectRef of a KVPayload
    transport: str = "object_store"


class KVTransport(ABC):
    """One replica's end of a transport; each engine replica builds its own from the config."""

    name: str

    def attach(self, engine: LLMEngine, release: Callable[[str], None]) -> None:
        """Called once when the replica starts: the engine whose cache this replica serves,
        and how to free a handed-off prompt's held blocks (by handoff id, thread-safe)."""
        self.engine = engine
        self.release = release

    @abstractmethod
    def export(self, handoff: KVHandoff) -> KVHandoff:
        """Prefill side: the handoff with this transport's ticket; owns the hold from now on."""

    @abstractmethod
    async def receive(self, handoff: KVHandoff, timeout_s: float) -> KVImport:
        """Decode side: what the engine imports the KV from, within ``timeout_s``; raises
        KVTransportError / TimeoutError when the KV cannot be had."""

    def num_held(self) -> int:
        """Handed-off prompts whose blocks this (prefill) replica holds for a decode replica."""
        return 0

    # -- delivery: the prefill replica sends the handoff to a decode replica waiting for it --

    def expect(self, key: str) -> KVDestination:
        """Decode side (the replica's event loop): where a prefill replica is to deliver a
        handoff for this replica under ``key``; ``forget(key)`` once the caller stops
        waiting for it."""
        raise KVTransportError(f"the {self.name} transport does not deliver handoffs")

    async def wait(self, key: str, timeout_s: float) -> KVHandoff:
        """Decode side: the handoff delivered under ``key``, within ``timeout_s``
        (TimeoutError)."""
        raise KVTransportError(f"the {self.name} transport does not deliver handoffs")

    def forget(self, key: str) -> None:
        """Decode side: stops waiting under ``key`` (a no-op once ``wait`` returned it); a
        handoff delivered and not taken, or delivered later, is declined, which frees its
        blocks on the prefill replica."""
        return None

    async def deliver(self, handoff: KVHandoff, destination: KVDestination) -> None:
        """Prefill side: sends an exported handoff to the decode replica waiting for it;
        KVTransportError if it cannot (the handoff is then still this replica's to return)."""
        raise KVTransportError(f"the {self.name} transport does not deliver handoffs")

    def close(self) -> None:
        """Releases agents and tasks; the replica is going away."""
        return None


class ObjectStoreTransport(KVTransport):
    """Ray's object store: the KV copied out of the blocks, read zero-copy by the decode side."""

    name = "object_store"

    def export(self, handoff: KVHandoff) -> KVHandoff:
        try:
            payload = self.engine.read_kv(handoff)
        finally:
            self.release(handoff.handoff_id)
        return replace(handoff, ticket=ObjectStoreTicket(ray.put(payload)))

    async def receive(self, handoff: KVHandoff, timeout_s: float) -> KVImport:
        ticket = handoff.ticket
        if not isinstance(ticket, ObjectStoreTicket):
            raise KVTransportError(f"an object_store replica was given {ticket!r}")
        payload = await asyncio.wait_for(ticket.ref, timeout_s)
        assert isinstance(payload, KVPayload), type(payload)
        return payload


def make_transport(config: KVTransportConfig) -> KVTransport:
    """The transport the config names; NIXL loads only here."""
    if config.name == "nixl":
        from deployments.nixl_transport import NixlTransport

        return NixlTransport(
            config.nixl_backend, config.hold_timeout_s, layer_wise=config.nixl_layer_wise
        )
    return ObjectStoreTransport()
