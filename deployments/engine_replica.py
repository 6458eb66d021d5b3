"""What every engine-owning deployment shares: one AsyncEngine per replica, stats, health."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
import torch
from ray import serve
from ray.serve.exceptions import RayServeException

import deployments.parallel_ranks  # noqa: F401  (distributed_executor_backend "ray")
from deployments import ray_metrics
from deployments.profiling import ProfiledReplica
from deployments.protocol import ChannelRequest, ImagePart, SeqDelta, StepOutput
from deployments.step_channel import ChannelItem, StepPublisher, this_node
from deployments.thread_priority import current_nice, lower_priority, thread_ids
from neuron_runtime import AsyncEngine, EngineArgs, tracing
from neuron_runtime.accuracy.online import OnlineValidationConfig, OnlineValidator
from neuron_runtime.multimodal import MultiModalInput
from neuron_runtime.outputs import RequestOutput

logger = logging.getLogger("ray.serve")


def replica_num_threads() -> int | None:
    """This replica's CPU allotment (``ray_actor_options.num_cpus``) rounded up, at least 1;
    None outside Ray (the engine then takes the host's usable cores)."""
    if not ray.is_initialized():  # get_runtime_context() would start a local cluster
        return None
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
    return max(1, math.ceil(round(cpus, 4)))


class EngineReplica(ProfiledReplica):
    """Base of LLMServer, PrefillServer and DecodeServer; tests may pass a fake ``engine_cls``."""

    trace_role = "engine"  # names its spans and its process in traces

    def __init__(
        self,
        engine_args: dict[str, Any],
        engine_cls: type[AsyncEngine] | None = None,
        stall_timeout_s: float = 30.0,
        tracing_config: dict[str, Any] | None = None,
        accuracy: OnlineValidationConfig | None = None,
        serving_threads_nice: int | None = None,
    ) -> None:
        # The threads there are before the engine's: lowered once it runs (lower_serving_threads),
        # behind the engine's, which start at this thread's value.
        self._serving_threads = thread_ids()
        self._engine_nice = current_nice()
        if self._engine_nice > 0:
            logger.warning(
                "the engine's threads run at nice %d (Ray's worker_niceness), behind Ray's own "
                "daemons and threads: start Ray with RAY_worker_niceness=0, as the Makefile does",
                self._engine_nice,
            )
        self.serving_threads_nice = serving_threads_nice
        tracing.configure(tracing_config, self.trace_role)
        # Several replicas, the ingress and Ray share the CPUs: oversubscribed thread pools
        # slow every process down (PERF.md). The engine's pools (the CPU kernels' and torch's)
        # take num_threads, by default the CPUs this replica was given.
        torch.set_num_threads(1)
        engine_cls = engine_cls or AsyncEngine
        args = EngineArgs(**engine_args)
        if args.num_threads is None:
            args = dataclasses.replace(args, num_threads=replica_num_threads())
        self.engine = engine_cls.from_engine_args(args)
        self.block_size = args.block_size
        self.profile_backend = args.device
        self.stall_timeout_s = stall_timeout_s
        try:
            context = serve.get_replica_context()
            self.replica_id, deployment = context.replica_id.unique_id, context.deployment
        except (RuntimeError, RayServeException):  # outside a replica (unit tests, benchmarks)
            self.replica_id, deployment = "local", type(self).__name__
        self.publisher = StepPublisher(self.replica_id, this_node())
        # Serve runs one replica per actor process: its instruments are the process's.
        self.metrics = ray_metrics.EngineMetrics(
            deployment, str(args.model), record=self.replica_id != "local"
        )
        ray_metrics.current = self.metrics
        # Online validation (accuracy.sample_rate > 0): a worker thread and a reference model.
        self.online_validation: OnlineValidator | None = None
        if accuracy is not None and accuracy.enabled:
            self.online_validation = OnlineValidator(
                accuracy, self.metrics.observe_online_check, self.metrics.observe_online_drop
            ).attach(self.engine.engine)

    def lower_serving_threads(self) -> None:
        """Puts the threads this replica had before its engine (Ray's and Serve's, the event
        loop serving its calls) at least ``serving_threads_nice`` steps behind the engine's,
        so none preempts them (deployments/thread_priority.py). The last step of a
        replica's construction: threads made before it (the engine's, a KV transport's) keep
        the default."""
        lower_priority(self._serving_threads, self.serving_threads_nice, self._engine_nice)

    def stats(self) -> dict[str, Any]:
        stats = {"replica_id": self.replica_id, **dataclasses.asdict(self.engine.stats())}
        stats["step_channels_opened"] = dict(self.publisher.num_opened)
        if self.online_validation is not None:
            stats["online_validation"] = dataclasses.asdict(self.online_validation.stats())
        return stats

    async def channel(self, request: ChannelRequest) -> AsyncIterator[ChannelItem]:
        """A downstream's step channel: its requests' steps after their first, one message
        per wake-up (deployments/step_channel.py)."""
        async for batch in self.publisher.channel(request):
            yield batch

    def check_health(self) -> None:
        """Ray Serve's health probe: raises when the engine loop died or is stuck."""
        self.engine.check_health(stall_timeout_s=self.stall_timeout_s)
        self.metrics.observe_stats(self.engine.stats())

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Signals for the application's autoscaling policy (router/autoscaling.py); Serve
        averages them over the deployment's look-back window."""
        stats = self.engine.stats()
        self.metrics.observe_stats(stats)
        return {
            "num_running": float(stats.num_running),
            "num_waiting": float(stats.num_waiting),
            "kv_cache_usage": float(stats.kv_cache_usage),
            "ttft_s": self.metrics.recent_ttft_s(),
        }

    def record_routing_stats(self) -> dict[str, Any]:
        """Load figures Serve hands to this deployment's request router (router/)."""
        stats = self.engine.stats()
        return {
            "report_id": time.time(),
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_free_blocks": stats.num_kv_blocks_free,
            "kv_total_blocks": stats.num_kv_blocks_total,
            "block_size": self.block_size,
        }


async def image_inputs(images: list[ImagePart]) -> dict[str, Any]:
    """The engine's keyword arguments for a request's images (none for a text prompt).

    Features computed by a vision encoder replica are read from the object store (zero-copy
    numpy); images that came as bytes are encoded by the engine's own vision tower.
    """
    if not images:
        return {}
    refs = [part.features for part in images if part.features is not None]
    features = iter(await asyncio.gather(*refs))
    return {
        "mm_inputs": [
            MultiModalInput(
                part.offset,
                part.length,
                part.content_hash,
                features=None if part.features is None else next(features),
                image=part.data if part.features is None else None,
            )
            for part in images
        ]
    }


def to_step_output(out: RequestOutput, with_queue_time: bool = False) -> StepOutput:
    if out.finished and ray_metrics.current is not None:
        ray_metrics.current.observe_finished(out)
    seqs = [
        SeqDelta(
            index=c.index,
            token_ids=list(c.token_ids),
            logprobs=c.logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason if isinstance(c.stop_reason, int) else None,
        )
        for c in out.outputs
        if c.token_ids or c.finish_reason is not None
    ]
    queue_time = prefill_time = None
    scheduled = out.metrics.get("first_scheduled_time")
    if with_queue_time and scheduled is not None:
        queue_time = max(0.0, scheduled - out.metrics["arrival_time"])
        first_token = out.metrics.get("first_token_time")
        prefill_time = None if first_token is None else max(0.0, first_token - scheduled)
    return StepOutput(
        seqs=seqs,
        num_prompt_tokens=len(out.prompt_token_ids),
        num_cached_tokens=out.num_cached_tokens,
        finished=out.finished and out.kv_handoff is None,  # a handed-off request goes on
        error=out.error,
        queue_time_s=queue_time,
        prefill_time_s=prefill_time,
        prompt_logprobs=out.prompt_logprobs,
    )
