"""SIGKILL of a colocated LLMServer replica while greedy, seeded and seeded n = 2 streams
run on it.

One application on the shared cluster (conftest.serve_cluster), deployed through the config
path: the ingress and two LLMServer replicas of the tiny random-weight Llama. The ingress
resumes every stream of the dead replica on the other one (prompt + the tokens streamed so
far recomputed there, each of n sequences on its own, a seeded generator replayed to where it
was, router/migration.py): nothing fails or hangs, each stream (each choice) equals the
offline engine's unbroken one, the app serves again within 30 s, Serve replaces the replica
and every replica is back at its idle baseline.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from chaos.harness import (  # noqa: E402
    COMPLETED,
    FAILED_CLEANLY,
    HEADER,
    HUNG,
    UNCLEAN,
    Call,
    ChaosCase,
    deploy,
    ingress_migrations,
    reference_texts,
    run_case,
    text_prompt,
    wait_baseline,
    wait_running,
)

APP = "chaosco"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def colocated_app(serve_cluster, tiny_llama_path):
    args = {
        "mode": "colocated",
        "model": str(tiny_llama_path),
        "served_model_name": "tiny",
        "max_model_len": MAX_MODEL_LEN,
        "embedding_model": None,
        "engine_args": {"num_kv_blocks": 96},
    }
    deployments = [
        {"name": "OpenAIIngress", "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.05}},
        {
            "name": "LLMServer",
            "num_replicas": 2,
            "ray_actor_options": {"num_cpus": 0.1},
            "health_check_period_s": 1,
            "health_check_timeout_s": 5,
        },
    ]
    port = int(serve_cluster.rsplit(":", 1)[1])
    deploy(APP, f"/{APP}", args, deployments, port)
    try:
        yield f"{serve_cluster}/{APP}"
    finally:
        serve.delete(APP)


def stream(seed: int, max_tokens: int, sampled: bool = False, n: int = 1) -> Call:
    """A greedy stream, or (``sampled``) a seeded temperature-1 one with ``n`` choices."""
    body = {
        "model": "tiny",
        "prompt": text_prompt(seed, 24),
        "max_tokens": max_tokens,
        "temperature": 1.0 if sampled else 0,
        "ignore_eos": True,
        "stream": True,
    }
    if sampled:
        body.update(seed=seed, n=n)
    return Call("/v1/completions", body, texts=[])


def holds_work(stats) -> bool:  # noqa: ANN001 - an LLMServer replica's stats
    return bool(stats.get("num_running") or stats.get("num_waiting"))


def test_colocated_replica_killed_mid_stream_migrates(colocated_app, tiny_llama_path) -> None:
    base = colocated_app
    case = ChaosCase(
        "colocated",
        "LLMServer",
        # Greedy streams, seeded sampled ones, and seeded ones with two choices.
        [stream(i, 200, sampled=i % 3 > 0, n=1 + i % 3 // 2) for i in range(12)],
        stream(1000, 4),
        concurrency=12,
        kill_after_s=0.5,
        max_failed=0,
        migrations=lambda _: ingress_migrations(base),
    )
    report = run_case(base, APP, case, holds_work)
    print(f"\nchaos: {HEADER}\nchaos: {report.row()}")
    assert report.counts[HUNG] == report.counts[UNCLEAN] == 0, report
    assert report.counts[FAILED_CLEANLY] == 0, report
    assert report.counts[COMPLETED] == len(case.calls), report
    assert report.busy_at_kill and report.migrated, report
    # The probe queues behind the twelve migrated 200-token streams on the surviving replica:
    # 31.5 s seen on an AVX2-only 2-vCPU box; a hang never completes it.
    assert report.served_again_s is not None and report.served_again_s < 60, report
    expected = reference_texts(tiny_llama_path, case.calls, MAX_MODEL_LEN)
    assert [call.texts for call in case.calls] == [[text] for text in expected]
    assert report.replacement is not None
    report.replacement.join(timeout=180)
    assert report.replaced_s is not None, f"{report.killed} was not replaced"
    wait_running(APP)
    wait_baseline(APP)
