"""Replica choice policies on fake replica states (no Ray), and the serve configs' shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from router.policies import (
    KVCapacityPolicy,
    PrefixAffinityPolicy,
    ReplicaLoad,
    power_of_two,
    rendezvous_rank,
)

ROOT = Path(__file__).resolve().parents[1]


def ids(ranks: list[list[ReplicaLoad]]) -> list[list[str]]:
    return [[r.replica_id for r in rank] for rank in ranks]


def loads(*queues: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", q) for i, q in enumerate(queues)]


def test_power_of_two_orders_by_queue_length():
    import random

    rng = random.Random(0)
    replicas = loads(5, 1, 3, 0)
    for _ in range(50):
        picked = power_of_two(replicas, rng)
        assert len(picked) == 2 and picked[0].queue_len <= picked[1].queue_len
    assert [r.replica_id for r in power_of_two(loads(3), rng)] == ["r0"]


def test_power_of_two_breaks_ties_at_random():
    import random

    rng = random.Random(0)
    firsts = [power_of_two(loads(2, 2), rng)[0].replica_id for _ in range(200)]
    assert 60 < firsts.count("r0") < 140  # binomial(200, 0.5): outside this ~1e-8
    assert all(power_of_two(loads(3, 1), rng)[0].replica_id == "r1" for _ in range(20))


def test_affinity_prefers_the_replica_that_holds_the_prefix():
    policy = PrefixAffinityPolicy(min_match_share=0.5, seed=0)
    prompt = ["a", "b", "c", "d"]
    policy.record(prompt[:3], "r1")
    policy.record(prompt[:1], "r2")
    ranks = policy.rank(prompt, loads(0, 2, 0))
    assert ids(ranks)[0] == ["r1"]  # 3 of 4 blocks there, its queue within the imbalance
    assert "r1" not in ids(ranks)[1]  # the fallback rank is a load-based pair without it
    assert policy.matched_blocks(prompt, "r2") == 1


def test_affinity_gives_way_to_load_and_to_small_matches():
    policy = PrefixAffinityPolicy(min_match_share=0.5, max_imbalance=3, seed=0)
    prompt = ["a", "b", "c", "d"]
    policy.record(prompt, "r0")
    # r0 holds everything but is 4 requests behind the shortest queue: load wins.
    assert ids(policy.rank(prompt, loads(5, 1)))[0] == ["r1", "r0"]
    # A match below min_match_share is not worth a longer queue either.
    other = ["a", "x", "y", "z"]
    assert len(policy.rank(other, loads(0, 0))) == 1
    # The chain matters: a block hash only counts after its whole prefix matched.
    assert policy.matched_blocks(["x", "b"], "r0") == 0


def test_affinity_forgets_dead_replicas_and_bounds_its_memory():
    policy = PrefixAffinityPolicy(capacity=3, seed=0)
    policy.record(["a", "b"], "r0")
    policy.forget("r0")
    assert policy.matched_blocks(["a", "b"], "r0") == 0
    policy.record(["a", "b", "c", "d", "e"], "r1")
    assert policy.matched_blocks(["a"], "r1") == 0  # the oldest hashes were evicted
    assert policy.matched_blocks(["c"], "r1") == 1
    with pytest.raises(ValueError, match="min_match_share"):
        PrefixAffinityPolicy(min_match_share=0)


def test_kv_capacity_picks_most_free_blocks_and_counts_what_it_sent():
    policy = KVCapacityPolicy(seed=0)
    replicas = [
        ReplicaLoad("r0", 0, kv_free_blocks=100, report_id=1.0),
        ReplicaLoad("r1", 0, kv_free_blocks=300, report_id=1.0),
        ReplicaLoad("r2", 0, kv_free_blocks=5, report_id=1.0),
    ]
    assert ids(policy.rank(10, replicas))[0] == ["r1", "r0"]  # r2 cannot hold 10 blocks
    policy.record(250, "r1")  # r1 now has ~50 free until it reports again
    assert ids(policy.rank(10, replicas))[0] == ["r0", "r1"]
    fresh = [ReplicaLoad("r1", 0, kv_free_blocks=280, report_id=2.0), replicas[0]]
    assert ids(policy.rank(10, fresh))[0] == ["r1", "r0"]  # a new report resets the estimate


def test_kv_capacity_without_reports_falls_back_to_load():
    policy = KVCapacityPolicy(seed=0)
    ranks = policy.rank(10, loads(4, 1))
    assert ids(ranks) == [["r1", "r0"]]
    full = [ReplicaLoad("r0", 0, kv_free_blocks=2, report_id=1.0)]
    assert ids(policy.rank(10, full)) == [["r0"]]  # nobody fits: the replica queues it


def test_rendezvous_spreads_keys_and_moves_only_the_removed_replicas():
    replicas = [ReplicaLoad(f"r{i}") for i in range(4)]
    keys = [f"image-{i}" for i in range(400)]

    def owners(pool: list[ReplicaLoad]) -> dict[str, str]:
        return {key: rendezvous_rank(key, pool)[0][0].replica_id for key in keys}

    before = owners(replicas)
    counts = {r.replica_id: list(before.values()).count(r.replica_id) for r in replicas}
    assert all(60 <= c <= 140 for c in counts.values()), counts  # ~100 each
    # Order of the candidates does not matter; every rank holds one replica, all of them.
    assert owners(replicas[::-1]) == before
    ranks = rendezvous_rank("image-0", replicas)
    assert sorted(r[0].replica_id for r in ranks) == ["r0", "r1", "r2", "r3"]
    after = owners(replicas[1:])  # r0 removed
    moved = [key for key in keys if before[key] != after[key]]
    assert moved and all(before[key] == "r0" for key in moved)
    # A key's second choice is where it goes when its owner leaves.
    assert all(after[key] == rendezvous_rank(key, replicas)[1][0].replica_id for key in moved)
    assert rendezvous_rank("x", []) == []


@pytest.mark.parametrize(
    "path", ["serve_config.yaml", "configs/serve/colocated.yaml", "configs/serve/epd.yaml"]
)
def test_serve_configs_validate_and_name_the_built_deployments(path):
    from ray.serve.schema import ServeDeploySchema

    from app.builder import BuildArgs

    config = yaml.safe_load((ROOT / path).read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    args = BuildArgs(**app["args"])
    listed = {d["name"] for d in app["deployments"]}
    pd = {"PDRouter", "PrefillServer", "DecodeServer"}
    engine_side = pd if args.mode == "disaggregated" else {"LLMServer"}
    encoder = {"VisionEncoder"} if args.separate_encoder() else set()
    embedder = {"EmbeddingServer"} if args.embedding_model else set()
    assert listed == {"OpenAIIngress"} | embedder | engine_side | encoder
    assert config["http_options"]["host"] == "127.0.0.1"
