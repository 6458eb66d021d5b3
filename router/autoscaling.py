"""Application-level autoscaling for the disaggregated app: prefill, decode and encoders together.

Ray Serve (2.60) calls an application's ``autoscaling_policy`` once per control-loop tick with
the ``AutoscalingContext`` of every autoscaled deployment of the app and applies the replica
counts it returns (after each deployment's own bounds, delays and smoothing factors). A policy
given as a class is built once with ``policy_kwargs``:

    autoscaling_policy:
      policy_function: router.autoscaling:PDAutoscalingPolicy
      policy_kwargs: {ttft_target_s: 1.0, max_decode_per_prefill: 4.0}

Signals (``AutoscalingContext.aggregated_metrics``, averaged by Serve over each deployment's
look-back window, one value per replica) come from the engine replicas'
``record_autoscaling_stats`` (deployments/engine_replica.py); the built-in request counts
(``total_num_requests``: running and queued at the replicas and the handles) stand in where a
replica has not reported yet:

- prefill: its ongoing requests per replica against ``prefill_target_ongoing``, raised while the
  engines' recent time to first token (``ttft_s``) is above ``ttft_target_s``;
- decode: running and waiting requests per replica against ``decode_target_running``, and the
  KV-cache usage against ``kv_usage_target`` (a decode replica is full when its KV is);
- decode/prefill kept within [min_decode_per_prefill, max_decode_per_prefill] by raising the
  smaller side, so a burst grows both;
- each side moved only as far as the ratio allows against the other side's current target:
  Serve runs each deployment's upscale/downscale delay on its own clock, so a decision for both
  can land on one deployment ticks before the other. Returning, for each side, a count within
  the ratio of the other's target (and of the other's new count) keeps every pair of targets
  Serve can hold within the ratio. A burst that needs more than the ratio at once grows the two
  sides in turn, each step at most the ratio;
- encoders: ongoing requests per replica against ``encoder_target_ongoing``;
- any other autoscaled deployment: Serve's default (ongoing requests / target_ongoing_requests).

Scale-down sheds at most ``max_scale_down_step`` replicas of a deployment per decision, counted
from its current target (replicas still starting included): Serve
drains a leaving replica (it takes no new requests and finishes its ongoing ones within the
deployment's graceful_shutdown_timeout_s), and a decode replica's ongoing requests are long
streams, so replicas leave a few at a time.

Everything here is plain arithmetic on the contexts: no engine or Serve internals, so the policy
is tested on fabricated contexts (tests/test_autoscaling_policy.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve._private.common import DeploymentID
    from ray.serve.config import AutoscalingContext

# What engine replicas report through record_autoscaling_stats (deployments/engine_replica.py).
NUM_RUNNING = "num_running"
NUM_WAITING = "num_waiting"
KV_CACHE_USAGE = "kv_cache_usage"
TTFT_S = "ttft_s"


@dataclass(frozen=True)
class PDAutoscalingPolicy:
    """``policy(contexts) -> ({deployment_id: replicas}, {deployment_id: state})``."""

    prefill_deployment: str = "PrefillServer"
    decode_deployment: str = "DecodeServer"
    encoder_deployment: str = "VisionEncoder"
    prefill_target_ongoing: float = 16.0
    ttft_target_s: float = 1.0
    # A TTFT above target multiplies prefill replicas by ttft/target, at most this much per tick.
    max_ttft_scale_up: float = 2.0
    decode_target_running: float = 32.0
    kv_usage_target: float = 0.75
    encoder_target_ongoing: float = 8.0
    min_decode_per_prefill: float = 1.0
    max_decode_per_prefill: float = 4.0
    max_scale_down_step: int = 1

    def __post_init__(self) -> None:
        positive = (
            "prefill_target_ongoing",
            "ttft_target_s",
            "decode_target_running",
            "encoder_target_ongoing",
            "min_decode_per_prefill",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.kv_usage_target <= 1:
            raise ValueError(f"kv_usage_target must be in (0, 1], got {self.kv_usage_target}")
        if self.max_decode_per_prefill < self.min_decode_per_prefill:
            raise ValueError(
                f"max_decode_per_prefill ({self.max_decode_per_prefill}) is below "
                f"min_decode_per_prefill ({self.min_decode_per_prefill})"
            )
        if self.max_ttft_scale_up < 1:
            raise ValueError(f"max_ttft_scale_up must be >= 1, got {self.max_ttft_scale_up}")
        if self.max_scale_down_step < 1:
            raise ValueError(f"max_scale_down_step must be >= 1, got {self.max_scale_down_step}")

    def __call__(
        self, contexts: Mapping[DeploymentID, AutoscalingContext]
    ) -> tuple[dict[DeploymentID, int], dict[DeploymentID, dict[str, Any]]]:
        by_name = {ctx.deployment_name: dep_id for dep_id, ctx in contexts.items()}
        wanted: dict[DeploymentID, int] = {}
        reasons: dict[DeploymentID, str] = {}
        for dep_id, ctx in contexts.items():
            name = ctx.deployment_name
            if name == self.prefill_deployment:
                wanted[dep_id], reasons[dep_id] = self.prefill_need(ctx)
            elif name == self.decode_deployment:
                wanted[dep_id], reasons[dep_id] = self.decode_need(ctx)
            elif name == self.encoder_deployment:
                wanted[dep_id] = need(ctx.total_num_requests, self.encoder_target_ongoing)
                reasons[dep_id] = "queue"
            else:
                target = ctx.config.get_target_ongoing_requests() if ctx.config else 1.0
                wanted[dep_id] = need(ctx.total_num_requests, target)
                reasons[dep_id] = "default"
        prefill, decode = by_name.get(self.prefill_deployment), by_name.get(self.decode_deployment)
        if prefill is not None and decode is not None:
            wanted[prefill], wanted[decode] = self.within_ratio(wanted[prefill], wanted[decode])
        decisions = {
            dep_id: self.stepped(contexts[dep_id], replicas) for dep_id, replicas in wanted.items()
        }
        if prefill is not None and decode is not None:
            decisions[prefill], decisions[decode] = self.coupled(
                decisions[prefill],
                decisions[decode],
                contexts[prefill].target_num_replicas,
                contexts[decode].target_num_replicas,
            )
        decisions = {
            dep_id: within_bounds(contexts[dep_id], replicas)
            for dep_id, replicas in decisions.items()
        }
        state = {
            dep_id: {"wanted": wanted[dep_id], "reason": reasons[dep_id]} for dep_id in decisions
        }
        return decisions, state

    def prefill_need(self, ctx: AutoscalingContext) -> tuple[int, str]:
        """Replicas for the prompts in flight and queued; more while TTFT is over target."""
        replicas = need(ctx.total_num_requests, self.prefill_target_ongoing)
        ttft = mean_over_replicas(ctx, TTFT_S)
        if ttft is not None and ttft > self.ttft_target_s and ctx.current_num_replicas > 0:
            factor = min(ttft / self.ttft_target_s, self.max_ttft_scale_up)
            by_ttft = math.ceil(ctx.current_num_replicas * factor)
            if by_ttft > replicas:
                return by_ttft, "ttft"
        return replicas, "queue"

    def decode_need(self, ctx: AutoscalingContext) -> tuple[int, str]:
        """Replicas for the running (and waiting) streams and for the KV they hold."""
        running = sum_over_replicas(ctx, NUM_RUNNING)
        waiting = sum_over_replicas(ctx, NUM_WAITING)
        if running is None:  # no replica has reported yet: Serve's request count
            return need(ctx.total_num_requests, self.decode_target_running), "requests"
        replicas, reason = need(running + (waiting or 0.0), self.decode_target_running), "running"
        usage = mean_over_replicas(ctx, KV_CACHE_USAGE)
        if usage is not None and ctx.current_num_replicas > 0:
            by_kv = math.ceil(ctx.current_num_replicas * usage / self.kv_usage_target - 1e-9)
            if by_kv > replicas:
                replicas, reason = by_kv, "kv_cache"
        return replicas, reason

    def within_ratio(self, prefill: int, decode: int) -> tuple[int, int]:
        """Raises the smaller side until decode/prefill is within the configured bounds."""
        if decode < math.ceil(prefill * self.min_decode_per_prefill - 1e-9):
            decode = math.ceil(prefill * self.min_decode_per_prefill - 1e-9)
        if decode > prefill * self.max_decode_per_prefill:
            prefill = math.ceil(decode / self.max_decode_per_prefill - 1e-9)
            # More prefill may need more decode again (a tight ratio: min close to max).
            decode = max(decode, math.ceil(prefill * self.min_decode_per_prefill - 1e-9))
        return prefill, decode

    def coupled(
        self, prefill: int, decode: int, prefill_target: int, decode_target: int
    ) -> tuple[int, int]:
        """Each side within the ratio of the other's current target (module docstring).

        Given targets within the ratio, the intervals below hold those targets, and the pair
        returned is within the ratio of each other too: Serve may apply either, both or
        neither this tick. Where neither side can move alone (a ratio with min == max) both
        move to the wanted pair at once, and Serve's delays may part them for a tick."""
        low, high = self.min_decode_per_prefill, self.max_decode_per_prefill
        wanted_prefill, wanted_decode = prefill, decode
        # Each interval holds the side's own target too, so targets outside the ratio (a
        # deployment's bounds, a redeploy) never push a side away from what it wants.
        prefill = clamp(
            prefill,
            min(prefill_target, math.ceil(decode_target / high - 1e-9)),
            max(prefill_target, math.floor(decode_target / low + 1e-9)),
        )
        decode = clamp(
            decode,
            min(decode_target, math.ceil(prefill_target * low - 1e-9)),
            max(decode_target, math.floor(prefill_target * high + 1e-9)),
        )
        # Both sides moving the same tick: the new pair keeps the ratio too.
        decode = clamp(decode, math.ceil(prefill * low - 1e-9), math.floor(prefill * high + 1e-9))
        if (prefill, decode) == (prefill_target, decode_target) != (wanted_prefill, wanted_decode):
            # A ratio too tight for one side to move alone (min == max): both move at once.
            return wanted_prefill, wanted_decode
        return prefill, decode

    def stepped(self, ctx: AutoscalingContext, replicas: int) -> int:
        """Scale-down a step at a time.

        The step counts from the larger of the target and the running replicas: replicas that
        are still starting count, so one low reading (a look-back window that fell between
        requests) cancels at most a step of a scale-up in flight, not all of it."""
        current = max(ctx.current_num_replicas, ctx.target_num_replicas or 0)
        return max(replicas, current - self.max_scale_down_step)


def within_bounds(ctx: AutoscalingContext, replicas: int) -> int:
    """Within the deployment's (capacity-adjusted) bounds: they win over the ratio."""
    return clamp(replicas, ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas)


def clamp(value: int, low: int, high: int) -> int:
    """``value`` within [low, high]; ``low`` wins when the interval is empty."""
    return max(low, min(high, value))


def need(load: float, per_replica: float) -> int:
    """Replicas that keep ``load`` at or under ``per_replica`` each (0 for no load)."""
    return max(0, math.ceil(load / per_replica - 1e-9))


def sum_over_replicas(ctx: AutoscalingContext, metric: str) -> float | None:
    """The metric summed over the replicas that reported it; None when none did."""
    values = (ctx.aggregated_metrics or {}).get(metric) or {}
    return float(sum(values.values())) if values else None


def mean_over_replicas(ctx: AutoscalingContext, metric: str) -> float | None:
    values = (ctx.aggregated_metrics or {}).get(metric) or {}
    return float(sum(values.values())) / len(values) if values else None
