"""Tensor-parallel ranks as Ray actors: ``distributed_executor_backend: ray``.

A Serve replica of a TP engine owns a placement group of ``tensor_parallel_size`` bundles
(the deployment's ``placement_group_bundles``; CPU, GPU or ``neuron_cores``). Serve places the
replica itself (rank 0: scheduler and shard 0) in bundle 0; each other rank is one
``RankWorker`` actor in bundle ``rank``, asking for that bundle's resources, so Ray pins it
(NEURON_RT_VISIBLE_CORES on Trainium). The actors start with the replica's engine and end
with it (``close``; Ray also reclaims them with the placement group when Serve replaces the
replica). A rank actor that dies fails the replica's health check (its ``run`` call returns),
and Serve starts a new replica with a new group.
"""

from __future__ import annotations

import uuid
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from neuron_runtime.config import EngineConfig
from neuron_runtime.parallel.executor import register_rank_launcher, run_worker


@ray.remote(num_cpus=0)
class RankWorker:
    """One rank other than 0: loads its shard and runs rank 0's calls until told to stop."""

    def run(self, config: EngineConfig, rank: int, init_method: str) -> None:
        run_worker(config, rank, init_method)


def bundle_options(bundle: dict[str, float]) -> dict[str, Any]:
    """Actor options asking for exactly a bundle's resources."""
    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    if custom:
        options["resources"] = custom
    return options


class RayRank:
    """A started rank actor (``RankHandle``)."""

    def __init__(self, config: EngineConfig, rank: int, init_method: str) -> None:
        group = get_current_placement_group()
        if group is None or len(group.bundle_specs) <= rank:
            raise ValueError(
                "distributed_executor_backend 'ray' needs a replica with placement_group_bundles "
                f"of tensor_parallel_size ({config.parallel.tensor_parallel_size}) bundles"
            )
        # Named, so an operator (or a test) can find a replica's ranks.
        self.name = f"neuron-tp-rank{rank}-{uuid.uuid4().hex[:8]}"
        self.actor = RankWorker.options(  # type: ignore[attr-defined]
            name=self.name,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank
            ),
            **bundle_options(group.bundle_specs[rank]),
        ).remote()
        self.done = self.actor.run.remote(config, rank, init_method)

    def is_alive(self) -> bool:
        ready, _ = ray.wait([self.done], timeout=0)
        return not ready

    def kill(self) -> None:
        ray.kill(self.actor)

    def join(self, timeout: float | None = None) -> None:
        ray.wait([self.done], timeout=timeout)


register_rank_launcher("ray", RayRank)
