"""A Serve replica of a TP=2 engine: the replica is rank 0, rank 1 an actor in the replica's
placement group (``distributed_executor_backend: ray``). Its greedy tokens equal the offline
TP=1 engine's; killing the rank actor fails the replica's health check and Serve replaces it.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from neuron_runtime import LLM, SamplingParams

pytestmark = pytest.mark.ray

PROMPT_IDS = [1, 504, 3458, 314, 4649, 28, 284, 260, 1589, 282]
MAX_TOKENS = 12


async def _generate(handle) -> tuple[list[int], str]:
    from deployments.protocol import GenerateRequest

    request = GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=PROMPT_IDS,
        sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
    )
    tokens: list[int] = []
    replica = ""
    async for step in handle.options(stream=True).generate.remote(request):
        for seq in step.seqs:
            tokens.extend(seq.token_ids)
        if step.stats:
            replica = step.stats["replica_id"]
    return tokens, replica


def _rank_actors(ray) -> list[tuple[str, str]]:
    return [
        (a["name"], a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("neuron-tp-rank1-")
    ]


def test_tp2_replica_answers_like_tp1_and_is_replaced_when_a_rank_dies(
    serve_cluster, tiny_llama_path
):
    import ray
    from ray import serve

    from deployments.llm_server import LLMServer

    expected = LLM(str(tiny_llama_path), max_model_len=128, num_kv_blocks=32, num_threads=1)
    want = (
        expected.generate(
            [{"prompt_token_ids": PROMPT_IDS}],
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        )[0]
        .outputs[0]
        .token_ids
    )
    app = LLMServer.options(
        name="TPServer",
        ray_actor_options={"num_cpus": 0.25},
        placement_group_bundles=[{"CPU": 0.25}, {"CPU": 0.25}],
        placement_group_strategy="STRICT_PACK",
        health_check_period_s=1,
        health_check_timeout_s=10,
    ).bind(
        engine_args={
            "model": str(tiny_llama_path),
            "tensor_parallel_size": 2,
            "distributed_executor_backend": "ray",
            "num_threads": 1,
            "max_model_len": 128,
            "num_kv_blocks": 32,
        }
    )
    handle = serve.run(app, name="tp2", route_prefix=None)
    try:
        tokens, replica = asyncio.run(_generate(handle))
        assert tokens == list(want)
        ranks = _rank_actors(ray)
        assert len(ranks) == 1
        ray.kill(ray.get_actor(*ranks[0]))
        deadline = time.monotonic() + 120
        while True:
            try:
                tokens, new_replica = asyncio.run(_generate(handle))
                if new_replica != replica:
                    break
            except Exception:  # noqa: BLE001 (the dying replica's requests fail)
                pass
            assert time.monotonic() < deadline, "Serve did not replace the replica"
            time.sleep(1)
        assert tokens == list(want)
        assert len(_rank_actors(ray)) == 1  # the new replica's rank; the old one is gone
    finally:
        serve.delete("tp2")
