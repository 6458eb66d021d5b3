"""Replica choice policies: plain classes over replica load snapshots, no Ray in them.

``router/request_routers.py`` adapts them to Ray Serve's request-router interface; tests drive
them with fake replica states.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    """What a router knows about one replica when it picks one."""

    replica_id: str
    queue_len: int = 0  # requests running or queued there (Serve's probe or cache)
    kv_free_blocks: int | None = None  # from the replica's routing stats; None: not reported
    report_id: float | None = None  # names the stats report kv_free_blocks comes from


def power_of_two(replicas: Sequence[ReplicaLoad], rng: random.Random) -> list[ReplicaLoad]:
    """Two random replicas, the shorter queue first (one when there is only one); equal
    queues in random order, so two idle replicas share the work."""
    picked = rng.sample(list(replicas), min(2, len(replicas)))
    return sorted(picked, key=lambda r: r.queue_len)


class PrefixAffinityPolicy:
    """Sends a prompt to the replica that already prefilled most of its leading blocks.

    The router remembers, per prompt block hash (a chain, so a hash names the whole prefix),
    which replicas it sent that block to, in an LRU of ``capacity`` hashes: the replicas'
    prefix caches evict too, so this is a hint, never a promise. A replica is preferred when
    it holds at least ``min_match_share`` of the prompt's blocks and its queue is at most
    ``max_imbalance`` longer than the shortest; otherwise power of two choices on queue length.
    """

    def __init__(
        self,
        min_match_share: float = 0.5,
        max_imbalance: int = 8,
        capacity: int = 100_000,
        seed: int | None = None,
    ) -> None:
        if not 0.0 < min_match_share <= 1.0:
            raise ValueError(f"min_match_share must be in (0, 1], got {min_match_share}")
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        self.min_match_share = min_match_share
        self.max_imbalance = max_imbalance
        self.capacity = capacity
        self.rng = random.Random(seed)
        self._holders: OrderedDict[str, set[str]] = OrderedDict()

    def matched_blocks(self, block_hashes: Sequence[str], replica_id: str) -> int:
        """How many leading blocks of the prompt this replica was sent."""
        count = 0
        for block_hash in block_hashes:
            holders = self._holders.get(block_hash)
            if holders is None or replica_id not in holders:
                break
            count += 1
        return count

    def rank(
        self, block_hashes: Sequence[str], replicas: Sequence[ReplicaLoad]
    ) -> list[list[ReplicaLoad]]:
        """Ranks of replicas to try in order: the affinity pick (if any), then two by load."""
        if not replicas:
            return []
        fallback = power_of_two(replicas, self.rng)
        if not block_hashes:
            return [fallback]
        shortest = min(r.queue_len for r in replicas)
        best, best_match = None, 0
        for replica in replicas:
            matched = self.matched_blocks(block_hashes, replica.replica_id)
            better = matched > best_match or (
                matched == best_match and best is not None and replica.queue_len < best.queue_len
            )
            if matched and better:
                best, best_match = replica, matched
        if (
            best is not None
            and best_match >= self.min_match_share * len(block_hashes)
            and best.queue_len - shortest <= self.max_imbalance
        ):
            return [[best], [r for r in fallback if r is not best] or [best]]
        return [fallback]

    def record(self, block_hashes: Sequence[str], replica_id: str) -> None:
        """Notes that ``replica_id`` prefilled (and so caches) these blocks."""
        for block_hash in block_hashes:
            holders = self._holders.get(block_hash)
            if holders is None:
                holders = self._holders[block_hash] = set()
            holders.add(replica_id)
            self._holders.move_to_end(block_hash)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        """A replica died or was removed: its cache is gone."""
        for holders in self._holders.values():
            holders.discard(replica_id)


class KVCapacityPolicy:
    """Sends a request to the decode replica with the most free KV blocks.

    Replicas report free blocks every few hundred milliseconds; between reports the policy
    subtracts what it has sent there since, so a burst does not pile onto one replica.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)
        self._sent: dict[str, int] = {}  # replica id -> blocks sent since its last report
        self._reports: dict[str, float | None] = {}  # replica id -> last report seen

    def free_blocks(self, replica: ReplicaLoad) -> int | None:
        if replica.kv_free_blocks is None:
            return None
        if self._reports.get(replica.replica_id) != replica.report_id:
            self._reports[replica.replica_id] = replica.report_id
            self._sent[replica.replica_id] = 0  # a fresh report already counts what we sent
        return replica.kv_free_blocks - self._sent.get(replica.replica_id, 0)

    def rank(self, blocks_needed: int, replicas: Sequence[ReplicaLoad]) -> list[list[ReplicaLoad]]:
        """Replicas that can hold the request, most free blocks first; unknown ones by load."""
        if not replicas:
            return []
        known = [(self.free_blocks(r), r) for r in replicas]
        fitting = sorted(
            ((free, r) for free, r in known if free is not None and free >= blocks_needed),
            key=lambda item: (-item[0], item[1].queue_len),
        )
        if fitting:
            return [[r for _, r in fitting[:2]], [r for _, r in fitting[2:]] or [fitting[0][1]]]
        # Nobody reported room: the replica's own scheduler queues (or preempts) as needed.
        return [power_of_two(replicas, self.rng)]

    def record(self, blocks: int, replica_id: str) -> None:
        self._sent[replica_id] = self._sent.get(replica_id, 0) + blocks


def rendezvous_score(key: str, replica_id: str) -> int:
    """Highest-random-weight score of ``replica_id`` for ``key`` (a digest: equal in every
    process, unlike Python's salted ``hash``)."""
    digest = hashlib.blake2b(f"{key}\0{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_rank(key: str, replicas: Sequence[ReplicaLoad]) -> list[list[ReplicaLoad]]:
    """Replicas for ``key`` by rendezvous hashing, one per rank: the owner first, then the
    next owner if it were gone, and so on.

    Every router process picks the same owner for a key without sharing state, and adding or
    removing a replica moves only the keys that replica owns, so an image repeated by any
    client reaches the encoder replica whose cache holds it. A busy owner is passed over only
    when its queue is full (Serve then tries the next rank).
    """
    ordered = sorted(replicas, key=lambda r: rendezvous_score(key, r.replica_id), reverse=True)
    return [[r] for r in ordered]
