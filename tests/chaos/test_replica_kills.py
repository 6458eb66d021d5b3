"""SIGKILL of a prefill, vision encoder, PD-router and embedding replica under load.

One application on the shared cluster (conftest.serve_cluster), deployed through the config
path: encode -> prefill -> decode on the tiny random-weight LLaVA plus the embedding model,
two replicas of each deployment under test (one decode replica: its kill, with migration, is
a case of its own). Each case runs a bounded load, kills one replica that holds work, and
checks: no request hung, none failed where the requests can be retried or migrated (prefill,
encoder, PD router, decode), every request got exactly one final answer (a response, or the
OpenAI error body / an SSE error event and [DONE]), the same kind of request is served again,
Serve replaced the replica, and every replica is back at its idle baseline. A table of the
cases is printed (completed, migrated, failed cleanly, unclean, hung, seconds to served
again, to replaced, to idle).
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
    ChaosReport,
    deploy,
    ingress_migrations,
    png_url,
    reference_texts,
    run_case,
    text_prompt,
    wait_baseline,
    wait_running,
)

APP = "chaos"
MODEL = "tiny"
MAX_MODEL_LEN = 512
FAST_HEALTH = {"health_check_period_s": 1, "health_check_timeout_s": 5}


def _deployment(name: str, replicas: int, cpus: float = 0.05, **options) -> dict:
    return {
        "name": name,
        "num_replicas": replicas,
        "ray_actor_options": {"num_cpus": cpus},
        **options,
    }


@pytest.fixture(scope="module")
def chaos_app(serve_cluster, tiny_llava_path):
    args = {
        "mode": "disaggregated",
        "model": str(tiny_llava_path),
        "served_model_name": MODEL,
        "max_model_len": MAX_MODEL_LEN,
        "embedding_model": "all-minilm-l6-v2",
        "max_body_bytes": 16 << 20,
        "engine_args": {"num_kv_blocks": 128},
        "multimodal": {"encoder": "separate"},
        "disaggregation": {"kv_hold_timeout_s": 5, "prefill_retries": 1},
    }
    deployments = [
        _deployment("OpenAIIngress", 1),
        _deployment("PDRouter", 2),
        _deployment("VisionEncoder", 2, **FAST_HEALTH),
        _deployment("PrefillServer", 2, 0.1, **FAST_HEALTH),
        _deployment("DecodeServer", 1, 0.1, **FAST_HEALTH),
        _deployment("EmbeddingServer", 2),
    ]
    port = int(serve_cluster.rsplit(":", 1)[1])
    deploy(APP, f"/{APP}", args, deployments, port)
    BASE[APP] = f"{serve_cluster}/{APP}"
    reports: list[ChaosReport] = []
    try:
        yield f"{serve_cluster}/{APP}", reports
    finally:
        serve.delete(APP)


BASE: dict[str, str] = {}  # app -> its base URL, once deployed


def completion(seed: int, prompt_len: int, max_tokens: int, stream: bool = False) -> Call:
    body = {
        "model": MODEL,
        "prompt": text_prompt(seed, prompt_len),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    return Call("/v1/completions", body, texts=[] if stream else None)


def image_chat(seed: int) -> Call:
    content = [
        {"type": "image_url", "image_url": {"url": png_url(seed, (512, 512))}},
        {"type": "text", "text": "What is in this picture?"},
    ]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
    }
    return Call("/v1/chat/completions", body)


def embedding(seed: int) -> Call:
    texts = [f"sentence {seed}-{i}: the quick brown fox jumps over the lazy dog" for i in range(32)]
    return Call("/v1/embeddings", {"model": "all-minilm-l6-v2", "input": texts})


CASES = [
    # Long prompts keep the prefill replicas busy. The router retries a lost prefill on the
    # other replica (prefill_retries), and a decode replica whose KV owner died recomputes the
    # prompt: nothing may fail.
    ChaosCase(
        "prefill",
        "PrefillServer",
        [completion(i, MAX_MODEL_LEN - 8, 2) for i in range(32)],
        completion(1000, 64, 2),
        concurrency=16,
        kill_after_s=0.2,
        max_failed=0,
    ),
    # Distinct 512x512 images: each one is decoded and encoded. An encode call whose replica
    # died is sent again and lands on the image's next owner in rendezvous order.
    ChaosCase(
        "encoder",
        "VisionEncoder",
        [image_chat(i) for i in range(24)],
        image_chat(1000),
        concurrency=12,
        kill_after_s=0.2,
        max_failed=0,
    ),
    # The ingress resumes each stream of the dead router on the other one (prompt + the
    # tokens streamed so far recomputed on the decode replica): nothing may fail and each
    # greedy stream must equal the offline engine's.
    ChaosCase(
        "pd-router",
        "PDRouter",
        [completion(i, 32, 64, stream=True) for i in range(16)],
        completion(1000, 32, 4, stream=True),
        concurrency=16,
        kill_after_s=0.5,
        max_failed=0,
        migrations=lambda app: ingress_migrations(BASE[app]),
    ),
    # The only decode replica dies with every stream mid-decode: the PD router resumes each
    # on the replacement (prompt + the tokens streamed so far recomputed there); nothing may
    # fail and each greedy stream must equal the offline engine's.
    ChaosCase(
        "decode",
        "DecodeServer",
        [completion(i, 32, 96, stream=True) for i in range(12)],
        completion(1000, 32, 4, stream=True),
        concurrency=12,
        kill_after_s=1.0,
        max_failed=0,
        migrations=lambda app: ingress_migrations(BASE[app]),
    ),
    ChaosCase(
        "embedding",
        "EmbeddingServer",
        [embedding(i) for i in range(24)],
        embedding(1000),
        concurrency=8,
        kill_after_s=0.5,
    ),
]


def holds_work(stats) -> bool:  # noqa: ANN001 - a replica's stats (a dict, a list for routers)
    if isinstance(stats, list):
        return stats[-1].get("num_kv_refs_held", 0) > 0
    keys = ("num_running", "num_waiting", "num_kv_blocks_used", "num_kv_handoffs_held")
    return any(stats.get(key) for key in (*keys, "num_pending"))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_replica_killed_under_load(chaos_app, tiny_llava_path, case: ChaosCase) -> None:
    base, reports = chaos_app
    report = run_case(base, APP, case, holds_work)
    reports.append(report)
    assert sum(report.counts.values()) == len(case.calls)
    assert report.counts[HUNG] == 0, report
    assert report.counts[UNCLEAN] == 0, report
    assert report.counts[COMPLETED] > 0, report
    if case.max_failed is not None:
        assert report.counts[FAILED_CLEANLY] <= case.max_failed, report
    assert report.served_again_s is not None, f"{case.name}: not served again"
    if case.migrations is not None:
        assert report.migrated is not None and report.migrated > 0, report
        assert report.served_again_s < 30, report
        expected = reference_texts(tiny_llava_path, case.calls, MAX_MODEL_LEN)
        assert [call.texts for call in case.calls] == [[text] for text in expected]


def test_killed_replicas_were_replaced_and_all_are_idle(chaos_app, capsys) -> None:
    """Serve replaced every killed replica; the table of the cases; the whole app idle."""
    _, reports = chaos_app
    for report in reports:
        assert report.replacement is not None
        report.replacement.join(timeout=180)
    with capsys.disabled():
        print(f"\nchaos: {HEADER}")
        for report in reports:
            print(f"chaos: {report.row()}")
    assert [r.case for r in reports] == [c.name for c in CASES]
    for report in reports:
        assert report.replaced_s is not None, f"{report.killed} was not replaced"
    wait_running(APP)
    wait_baseline(APP)
