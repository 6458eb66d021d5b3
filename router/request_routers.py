"""Ray Serve request routers for the prefill, decode and vision encoder deployments.

Serve builds one of these inside every process that holds a handle to the deployment (here:
the PD router's replicas). Each turns Serve's view of the replicas into ``ReplicaLoad``s and
asks a policy of ``router/policies.py``; Serve then probes the ranked replicas' queues and
sends the request to the first that accepts. For a traced request each records why it picked
the replica (router/route_trace.py).
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from deployments.protocol import ChannelRequest
from neuron_runtime.kv_transfer import prompt_block_hashes
from router.policies import (
    KVCapacityPolicy,
    PrefixAffinityPolicy,
    ReplicaLoad,
    power_of_two,
    rendezvous_rank,
)
from router.route_trace import RouteTrace


def _load(router: RequestRouter, replica: RunningReplica) -> ReplicaLoad:
    stats: dict[str, Any] = replica.routing_stats or {}
    queue_len = router.replica_queue_len_cache.get(replica.replica_id)
    if queue_len is None:
        queue_len = int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))
    return ReplicaLoad(
        replica_id=replica.replica_id.unique_id,
        queue_len=queue_len,
        kv_free_blocks=stats.get("kv_free_blocks"),
        report_id=stats.get("report_id"),
    )


def _request(pending: PendingRequest | None) -> Any:
    return pending.args[0] if pending is not None and pending.args else None


def _prompt_hashes(request: Any) -> tuple[str, ...]:
    """The prompt's block hash chain; blocks with image placeholders name their image."""
    return prompt_block_hashes(request.prompt_token_ids, request.images or None)


def _pinned(
    candidates: list[RunningReplica], pending: PendingRequest | None
) -> list[list[RunningReplica]] | None:
    """The replica a step channel names (every candidate if it is gone); None for others."""
    request = _request(pending)
    if not isinstance(request, ChannelRequest):
        return None
    named = [r for r in candidates if r.replica_id.unique_id == request.replica_id]
    return [named or candidates]


class _PolicyRouter(FIFOMixin, RequestRouter):
    """Maps policy ranks of ReplicaLoads back to Serve's RunningReplicas."""

    def _ranked(
        self, candidates: list[RunningReplica], ranks: list[list[ReplicaLoad]]
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidates}
        return [[by_id[load.replica_id] for load in rank] for rank in ranks if rank]


class PrefixAffinityRouter(_PolicyRouter):
    """Prefill replicas: prefix-cache affinity, else power of two choices on queue length."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = PrefixAffinityPolicy(**kwargs)
        self.trace = RouteTrace("prefill")

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        request = _request(pending_request)
        hashes = _prompt_hashes(request) if request is not None else ()
        loads = [_load(self, r) for r in candidate_replicas]
        if getattr(request, "trace_context", None) is not None:
            self.trace.note(
                pending_request,
                request,
                _seen(
                    loads,
                    match_shares=[self._match_share(hashes, load.replica_id) for load in loads],
                    min_match_share=self.policy.min_match_share,
                    prompt_blocks=len(hashes),
                ),
            )
        return self._ranked(candidate_replicas, self.policy.rank(hashes, loads))

    def _match_share(self, hashes: tuple[str, ...], replica_id: str) -> float:
        return self.policy.matched_blocks(hashes, replica_id) / len(hashes) if hashes else 0.0

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        request = _request(pending_request)
        if request is not None:
            hashes = _prompt_hashes(request)
            if getattr(request, "trace_context", None) is not None:
                share = self._match_share(hashes, replica_id.unique_id)
                affinity = bool(hashes) and share >= self.policy.min_match_share
                reason = "prefix_match" if affinity else "queue_length"
                self.trace.routed(pending_request, replica_id.unique_id, reason, match_share=share)
            self.policy.record(hashes, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)


class KVCapacityRouter(_PolicyRouter):
    """Decode replicas: the most free KV blocks that fit the request, else by queue length."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = KVCapacityPolicy(**kwargs)
        self.trace = RouteTrace("decode")

    def _blocks_needed(self, request: Any, candidates: list[RunningReplica]) -> int:
        if request is None or isinstance(request, ChannelRequest):
            return 0
        block_size = max(
            (int((r.routing_stats or {}).get("block_size", 16)) for r in candidates), default=16
        )
        tokens = len(request.prompt_token_ids) + int(request.sampling.get("max_tokens") or 0)
        return -(-tokens // block_size)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        pinned = _pinned(candidate_replicas, pending_request)
        if pinned is not None:
            return pinned
        request = _request(pending_request)
        needed = self._blocks_needed(request, candidate_replicas)
        loads = [_load(self, r) for r in candidate_replicas]
        if getattr(request, "trace_context", None) is not None:
            self.trace.note(
                pending_request,
                request,
                _seen(
                    loads,
                    # -1: the replica has not reported its KV cache yet
                    kv_free_blocks=[_or_minus_one(self.policy.free_blocks(load)) for load in loads],
                    kv_blocks_needed=needed,
                ),
            )
        return self._ranked(candidate_replicas, self.policy.rank(needed, loads))

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        request = _request(pending_request)
        needed = self._blocks_needed(request, list(self.curr_replicas.values()))
        if getattr(request, "trace_context", None) is not None:
            replica = self.curr_replicas.get(replica_id)
            free = None if replica is None else self.policy.free_blocks(_load(self, replica))
            reason = "kv_capacity" if free is not None and free >= needed else "queue_length"
            self.trace.routed(pending_request, replica_id.unique_id, reason, kv_free_blocks=free)
        self.policy.record(needed, replica_id.unique_id)


class LoadRouter(_PolicyRouter):
    """LLMServer and PDRouter replicas: power of two choices on queue length; step channels
    to the replica they name."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.rng = random.Random(kwargs.get("seed"))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        pinned = _pinned(candidate_replicas, pending_request)
        if pinned is not None:
            return pinned
        loads = [_load(self, r) for r in candidate_replicas]
        return self._ranked(candidate_replicas, [power_of_two(loads, self.rng), loads])


class RendezvousRouter(_PolicyRouter):
    """Vision encoder replicas: the owner of the image's content hash (rendezvous hashing), so
    repeats of an image hit the embedding cache of the replica that encoded it."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        request = _request(pending_request)
        loads = [_load(self, r) for r in candidate_replicas]
        if request is None:  # Serve's own probes carry no request
            return self._ranked(candidate_replicas, [loads])
        ranks = rendezvous_rank(request.content_hash, loads)
        if getattr(request, "trace_context", None) is not None:
            # In owner order: each rank's first replica.
            self.trace.note(pending_request, request, _seen([rank[0] for rank in ranks]))
        return self._ranked(candidate_replicas, ranks)

    def initialize_state(self, **kwargs: Any) -> None:
        self.trace = RouteTrace("encoder")

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        request = _request(pending_request)
        if getattr(request, "trace_context", None) is not None:
            # The owner of the image's hash, or a next one when the owner's queue was full.
            loads = [_load(self, r) for r in self.curr_replicas.values()]
            ranks = rendezvous_rank(request.content_hash, loads)
            owner = bool(ranks) and ranks[0][0].replica_id == replica_id.unique_id
            reason = "rendezvous_owner" if owner else "rendezvous_next_owner"
            self.trace.routed(pending_request, replica_id.unique_id, reason)


def _seen(loads: list[ReplicaLoad], **extra: Any) -> dict[str, Any]:
    """A route span's attributes: the candidates and their queue lengths, then ``extra``."""
    return {
        "neuron_serve.route.candidates": [load.replica_id for load in loads],
        "neuron_serve.route.queue_lengths": [load.queue_len for load in loads],
        **{f"neuron_serve.route.{key}": value for key, value in extra.items()},
    }


def _or_minus_one(value: int | None) -> int:
    return -1 if value is None else value
