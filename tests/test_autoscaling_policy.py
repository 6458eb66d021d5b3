"""router.autoscaling.PDAutoscalingPolicy on fabricated AutoscalingContexts (Ray 2.60's own class).

Each case states the load and the replica counts worked out by hand from the policy's rule
(docstring of router/autoscaling.py), then checks the policy and Serve's application-level
wrapper (which applies each deployment's bounds and delays) give them.
"""

from __future__ import annotations

import itertools
import math

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

from router.autoscaling import PDAutoscalingPolicy

APP = "text"
PREFILL, DECODE, ENCODER = (
    DeploymentID(n, APP) for n in ("PrefillServer", "DecodeServer", "VisionEncoder")
)


def context(
    dep_id: DeploymentID,
    replicas: int,
    requests: float,
    metrics: dict[str, list[float]] | None = None,
    min_replicas: int = 1,
    max_replicas: int = 16,
    queued: float = 0.0,
    target: int | None = None,
) -> AutoscalingContext:
    """``metrics``: per-replica values of each custom metric (as record_autoscaling_stats
    reports them, after Serve's look-back averaging). ``target``: the deployment's current
    target when replicas are still starting (``replicas`` of them run)."""
    ids = [ReplicaID(f"{dep_id.name}-{i}", dep_id) for i in range(replicas)]
    aggregated = {
        name: {ids[i]: value for i, value in enumerate(values)}
        for name, values in (metrics or {}).items()
    }
    config = AutoscalingConfig(
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        target_ongoing_requests=16,
        upscale_delay_s=0,
        downscale_delay_s=0,
    )
    return AutoscalingContext(
        deployment_id=dep_id,
        deployment_name=dep_id.name,
        app_name=APP,
        current_num_replicas=replicas,
        target_num_replicas=replicas if target is None else target,
        running_replicas=ids,
        total_num_requests=requests,
        total_queued_requests=queued,
        aggregated_metrics=aggregated,
        raw_metrics={},
        capacity_adjusted_min_replicas=min_replicas,
        capacity_adjusted_max_replicas=max_replicas,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=1000.0,
        config=config,
    )


def engine_metrics(running: list[float], waiting: list[float], kv: list[float], ttft: list[float]):
    return {"num_running": running, "num_waiting": waiting, "kv_cache_usage": kv, "ttft_s": ttft}


POLICY = PDAutoscalingPolicy(
    prefill_target_ongoing=16,
    ttft_target_s=1.0,
    decode_target_running=32,
    kv_usage_target=0.75,
    encoder_target_ongoing=8,
    min_decode_per_prefill=1.0,
    max_decode_per_prefill=4.0,
)


def decide_with_state(contexts: list[AutoscalingContext], policy: PDAutoscalingPolicy = POLICY):
    decisions, state = policy({c.deployment_id: c for c in contexts})
    assert set(state) == set(decisions)
    return decisions, state


def decide(contexts: list[AutoscalingContext], policy: PDAutoscalingPolicy = POLICY):
    return decide_with_state(contexts, policy)[0]


def test_burst_scales_prefill_and_decode_together_within_the_ratio() -> None:
    # 100 prompts: ceil(100 / 16) = 7 prefill (TTFT 0.5 s, under target). Decode: 40 running
    # + 8 waiting over 2 replicas -> ceil(48 / 32) = 2, KV 0.5 (under 0.75 on up to 7
    # replicas); the ratio (>= 1 decode per prefill) lifts decode to 7. Encoders: 30 images in
    # flight -> ceil(30 / 8) = 4.
    def contexts(prefill: int, decode: int) -> list[AutoscalingContext]:
        return [
            context(PREFILL, prefill, 100, engine_metrics([16], [84], [0.2], [0.5])),
            context(DECODE, decode, 48, engine_metrics([20, 20], [4, 4], [0.5, 0.5], [0.0, 0.0])),
            context(ENCODER, 1, 30, max_replicas=4),
        ]

    decisions, state = decide_with_state(contexts(1, 2))
    assert {dep: s["wanted"] for dep, s in state.items()} == {PREFILL: 7, DECODE: 7, ENCODER: 4}
    # Against the current targets (1 prefill, 2 decode), each side moves only as far as keeps
    # the ratio [1, 4] whichever Serve applies first: prefill to 2 (<= 2 decode / 1), decode
    # to 4 (<= 4 * 1 prefill). The next decisions, from those targets: (4, 7), then (7, 7).
    assert decisions == {PREFILL: 2, DECODE: 4, ENCODER: 4}
    assert decide(contexts(2, 4)) == {PREFILL: 4, DECODE: 7, ENCODER: 4}
    assert decide(contexts(4, 7)) == {PREFILL: 7, DECODE: 7, ENCODER: 4}


def test_decode_kv_pressure_lifts_prefill_to_the_ratio() -> None:
    # Decode KV full (1.0) on 8 replicas -> ceil(8 / 0.75) = 11; at most 4 decode per prefill
    # -> prefill ceil(11 / 4) = 3 though its own queue asks for 1. The targets (1, 8) are
    # outside the ratio: prefill goes to 3 and decode keeps its 8 (> 4 * 1) but no more.
    def contexts(prefill: int) -> list[AutoscalingContext]:
        return [
            context(PREFILL, prefill, 4, engine_metrics([4], [0], [0.1], [0.2])),
            context(DECODE, 8, 200, engine_metrics([25] * 8, [0] * 8, [1.0] * 8, [0.0] * 8)),
        ]

    assert decide(contexts(1)) == {PREFILL: 3, DECODE: 8}
    assert decide(contexts(3)) == {PREFILL: 3, DECODE: 11}


@pytest.mark.parametrize("ratio", [(1.0, 4.0), (1.0, 2.0), (0.5, 2.0), (0.25, 0.5)])
def test_targets_keep_the_ratio_whichever_side_serve_applies_first(ratio) -> None:
    """Serve runs each deployment's delays on its own clock: of one decision it may apply the
    prefill count, the decode count, both or neither this tick. From every pair of targets
    within the ratio, toward every pair of needs, each of those outcomes is within the ratio,
    and decisions repeated from the targets they produce reach the wanted pair."""
    low, high = ratio
    policy = PDAutoscalingPolicy(min_decode_per_prefill=low, max_decode_per_prefill=high)

    def within(prefill: int, decode: int) -> bool:
        return prefill * low - 1e-9 <= decode <= prefill * high + 1e-9

    for targets in itertools.product(range(1, 11), repeat=2):
        if not within(*targets):
            continue
        for needs in itertools.product(range(1, 15), range(0, 15)):
            goal = policy.within_ratio(*needs)
            if not within(*goal):  # (0.25, 0.5): no decode count for some prefill counts
                continue
            decided = policy.coupled(*goal, *targets)
            outcomes = [decided, (decided[0], targets[1]), (targets[0], decided[1])]
            assert all(within(*pair) for pair in outcomes), (targets, goal, decided)
            pair = targets
            for _ in range(16):
                if pair == goal:
                    break
                pair = policy.coupled(*goal, *pair)
            assert pair == goal, (targets, goal, pair)


def test_ttft_over_target_adds_prefill_replicas_capped_per_tick() -> None:
    # 20 prompts at 2 replicas -> ceil(20 / 16) = 2; TTFT 1.5 s vs 1 s -> ceil(2 * 1.5) = 3.
    slow = context(PREFILL, 2, 20, engine_metrics([8, 8], [2, 2], [0.3, 0.3], [1.5, 1.5]))
    assert decide([slow])[PREFILL] == 3
    # TTFT 10 s: the factor is capped at 2 -> 4.
    slower = context(PREFILL, 2, 20, engine_metrics([8, 8], [2, 2], [0.3, 0.3], [10.0, 10.0]))
    assert decide([slower])[PREFILL] == 4


def test_steady_load_keeps_the_counts() -> None:
    # 3 prefill replicas with 40 prompts (ceil(40/16) = 3), TTFT under target; 4 decode
    # replicas, 100 running (ceil(100/32) = 4), KV 0.6 (ceil(4 * 0.6 / 0.75) = 4).
    contexts = [
        context(PREFILL, 3, 40, engine_metrics([12] * 3, [1] * 3, [0.3] * 3, [0.5] * 3)),
        context(DECODE, 4, 100, engine_metrics([25] * 4, [0] * 4, [0.6] * 4, [0.0] * 4)),
        context(ENCODER, 2, 12, max_replicas=4),
    ]
    assert decide(contexts) == {PREFILL: 3, DECODE: 4, ENCODER: 2}


def test_drain_scales_down_one_replica_per_decision_to_the_minimum() -> None:
    replicas = {PREFILL: 4, DECODE: 8, ENCODER: 3}
    seen = []
    for _ in range(10):
        contexts = [
            context(
                PREFILL, replicas[PREFILL], 0, engine_metrics(*([[0.0] * replicas[PREFILL]] * 4))
            ),
            context(DECODE, replicas[DECODE], 0, engine_metrics(*([[0.0] * replicas[DECODE]] * 4))),
            context(ENCODER, replicas[ENCODER], 0, max_replicas=4),
        ]
        replicas = decide(contexts)
        seen.append(dict(replicas))
    assert seen[0] == {PREFILL: 3, DECODE: 7, ENCODER: 2}
    assert seen[-1] == {PREFILL: 1, DECODE: 1, ENCODER: 1}
    # Each step sheds at most one replica of each, and decode never falls below prefill.
    for before, after in zip(seen, seen[1:], strict=False):
        assert all(before[d] - after[d] <= 1 for d in after)
        assert after[DECODE] >= after[PREFILL]


def test_a_low_reading_cancels_a_scale_up_in_flight_a_step_at_a_time() -> None:
    # Decode's target is 6 while 1 replica runs (5 starting), and one look-back window saw it
    # idle: the decision sheds one of the starting replicas (5), not all of them (1); each
    # further low reading sheds one more.
    idle = engine_metrics([0.0], [0.0], [0.0], [0.0])
    assert decide([context(DECODE, 1, 0, idle, target=6)]) == {DECODE: 5}
    assert decide([context(DECODE, 1, 0, idle, target=5)]) == {DECODE: 4}
    # A drain in progress (target below the running count) still steps from the running count.
    assert decide([context(DECODE, 4, 0, engine_metrics(*([[0.0] * 4] * 4)), target=3)]) == {
        DECODE: 3
    }


def test_a_missing_deployment_or_missing_metrics() -> None:
    # No decode context (not autoscaled): prefill alone, no ratio to keep.
    assert decide([context(PREFILL, 1, 40, engine_metrics([16], [24], [0.5], [0.4]))]) == {
        PREFILL: 3
    }
    # Decode replicas that have not reported custom metrics yet: Serve's request count,
    # ceil(70 / 32) = 3.
    assert decide([context(DECODE, 1, 70)]) == {DECODE: 3}
    # Another autoscaled deployment: Serve's default rule, ceil(40 / 16) = 3.
    other = DeploymentID("EmbeddingServer", APP)
    assert decide([context(other, 1, 40)]) == {other: 3}


def test_bounds_win_over_the_ratio() -> None:
    # Idle: both want their minimum. Prefill's min_replicas is 3 and decode's max_replicas 2,
    # so the bounds hold 3 prefill against 2 decode, under the ratio's 1 decode per prefill.
    contexts = [
        context(PREFILL, 3, 0, engine_metrics([0] * 3, [0] * 3, [0.0] * 3, [0.0] * 3), 3),
        context(DECODE, 2, 0, engine_metrics([0] * 2, [0] * 2, [0.0] * 2, [0.0] * 2), 1, 2),
    ]
    assert decide(contexts) == {PREFILL: 3, DECODE: 2}


def test_serve_builds_the_policy_from_policy_kwargs_and_applies_it() -> None:
    """The config's autoscaling_policy goes through Serve's own path: AutoscalingPolicy
    imports and pickles the class, instantiates it with policy_kwargs, and the app-level
    wrapper returns bounded integer decisions."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable

    spec = AutoscalingPolicy(
        policy_function="router.autoscaling:PDAutoscalingPolicy",
        policy_kwargs={"max_decode_per_prefill": 2.0, "decode_target_running": 8},
    )
    policy = _resolve_policy_callable(spec)
    assert isinstance(policy, PDAutoscalingPolicy)
    assert policy.max_decode_per_prefill == 2.0
    wrapped = _apply_app_level_autoscaling_config(policy)
    contexts = {
        PREFILL: context(PREFILL, 3, 8, engine_metrics([8], [0], [0.1], [0.1])),
        DECODE: context(DECODE, 3, 40, engine_metrics([40], [0], [0.5], [0.0])),
    }
    decisions, _ = wrapped(contexts)
    # decode ceil(40 / 8) = 5; at most 2 decode per prefill -> prefill ceil(5 / 2) = 3 (its
    # target already), and 5 decode is within 2 per prefill of that target.
    assert decisions == {PREFILL: 3, DECODE: 5}
    assert all(isinstance(v, int) for v in decisions.values())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_usage_target": 0},
        {"kv_usage_target": 1.5},
        {"min_decode_per_prefill": 2.0, "max_decode_per_prefill": 1.0},
        {"ttft_target_s": -1},
        {"max_scale_down_step": 0},
    ],
)
def test_bad_kwargs_are_refused_naming_the_field(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs)) if len(kwargs) == 1 else "per_prefill"):
        PDAutoscalingPolicy(**kwargs)


def test_ratio_bounds_hold_for_any_needs() -> None:
    for prefill in range(1, 12):
        for decode in range(0, 50):
            p, d = POLICY.within_ratio(prefill, decode)
            assert p >= prefill and d >= decode
            assert d >= math.ceil(p * POLICY.min_decode_per_prefill) or d >= p
            assert d <= p * POLICY.max_decode_per_prefill
