"""Ray Serve request routers for the prefill, decode and vision encoder deployments.

Serve builds one of these inside every process that holds a handle to the deployment (here:
the PD router's replicas). Each turns Serve's view of the replicas into ``ReplicaLoad``s and
asks a policy of ``router/policies.py``; Serve then probes the ranked replicas' queues and
sends the request to the first that accepts.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from neuron_runtime.kv_transfer import prompt_block_hashes
from router.policies import (
    KVCapacityPolicy,
    PrefixAffinityPolicy,
    ReplicaLoad,
    rendezvous_rank,
)


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

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        request = _request(pending_request)
        hashes = _prompt_hashes(request) if request is not None else ()
        loads = [_load(self, r) for r in candidate_replicas]
        return self._ranked(candidate_replicas, self.policy.rank(hashes, loads))

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        request = _request(pending_request)
        if request is not None:
            self.policy.record(_prompt_hashes(request), replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)


class KVCapacityRouter(_PolicyRouter):
    """Decode replicas: the most free KV blocks that fit the request, else by queue length."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = KVCapacityPolicy(**kwargs)

    def _blocks_needed(self, request: Any, candidates: list[RunningReplica]) -> int:
        if request is None:
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
        needed = self._blocks_needed(_request(pending_request), candidate_replicas)
        loads = [_load(self, r) for r in candidate_replicas]
        return self._ranked(candidate_replicas, self.policy.rank(needed, loads))

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        needed = self._blocks_needed(_request(pending_request), list(self.curr_replicas.values()))
        self.policy.record(needed, replica_id.unique_id)


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
        return self._ranked(candidate_replicas, rendezvous_rank(request.content_hash, loads))
