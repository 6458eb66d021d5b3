"""Prefix-cache hit rate of the disaggregated app: prefix-affinity routing vs power of two.

One local cluster (127.0.0.1) runs two disaggregated apps with two prefill replicas each,
alike but for how the PD router picks a prefill replica. Both get the same workload, in
turns: ``--groups`` system prompts, each shared by ``--per-group`` chats with different
questions, sent in a shuffled order with ``--concurrency`` in flight. The hit rate is read
from each app's /metrics (vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total).

    python bench/prefix_affinity.py --groups 4 --per-group 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path

from local_cluster import start_local_serve, stop_local_serve

MODEL = "smollm2-135m-instruct"
ROUTINGS = ("prefix_affinity", "power_of_two")
TOPICS = ["geography", "cooking", "astronomy", "gardening", "music", "chess", "sailing", "law"]


def system_prompt(topic: str) -> str:
    return (
        f"You are an expert on {topic}. Answer in two sentences, name one source a beginner "
        f"could read next, and never use lists. If a question is not about {topic}, say so "
        "politely and suggest a question about it instead. Keep a friendly, plain tone."
    )


def metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


async def load(base: str, chats: list[list[dict]], concurrency: int) -> dict:
    import httpx

    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:
        before = (await client.get(f"{base}/metrics")).text

        async def one(messages: list[dict]) -> int:
            async with limit:
                body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
                return (await client.post(f"{base}/v1/chat/completions", json=body)).status_code

        start = time.perf_counter()
        codes = await asyncio.gather(*(one(m) for m in chats))
        elapsed = time.perf_counter() - start
        after = (await client.get(f"{base}/metrics")).text
    hits = metric(after, "vllm:prefix_cache_hits_total") - metric(
        before, "vllm:prefix_cache_hits_total"
    )
    queries = metric(after, "vllm:prefix_cache_queries_total") - metric(
        before, "vllm:prefix_cache_queries_total"
    )
    return {
        "ok": sum(c == 200 for c in codes),
        "hits": hits,
        "queries": queries,
        "seconds": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-group", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="bench/results/prefix_affinity.json")
    args = parser.parse_args()

    from ray import serve

    from app.builder import BuildArgs, build_openai_app

    results: dict[str, list[dict]] = {r: [] for r in ROUTINGS}
    port = start_local_serve()
    try:
        small = {"ray_actor_options": {"num_cpus": 0.1}}
        for routing in ROUTINGS:
            build = BuildArgs(
                mode="disaggregated",
                embedding_model=None,
                max_model_len=1024,
                disaggregation={"prefill_routing": routing},
            )
            app = build_openai_app(
                build,
                prefill_options={"num_replicas": 2, **small},
                decode_options=small,
                ingress_options=small,
            )
            serve.run(app, name=routing, route_prefix=f"/{routing}")
        rng = random.Random(args.seed)
        for round_index in range(args.rounds):
            # New system prompts each round, so no round starts with a warm cache.
            topics = [f"{t} (round {round_index})" for t in TOPICS[: args.groups]]
            chats = [
                [
                    {"role": "system", "content": system_prompt(topic)},
                    {"role": "user", "content": f"Question {q} about {topic}: where do I start?"},
                ]
                for topic in topics
                for q in range(args.per_group)
            ]
            rng.shuffle(chats)
            for routing in ROUTINGS:
                base = f"http://127.0.0.1:{port}/{routing}"
                results[routing].append(asyncio.run(load(base, chats, args.concurrency)))
    finally:
        stop_local_serve()

    print(
        f"{'prefill routing':<18}{'requests':>10}{'hit tokens':>12}{'queried':>10}{'hit rate':>10}"
    )
    summary = {}
    for routing, runs in results.items():
        hits, queries = sum(r["hits"] for r in runs), sum(r["queries"] for r in runs)
        ok = sum(r["ok"] for r in runs)
        rate = hits / queries if queries else 0.0
        summary[routing] = {"requests_ok": ok, "hits": hits, "queries": queries, "hit_rate": rate}
        print(f"{routing:<18}{ok:>10}{hits:>12.0f}{queries:>10.0f}{rate:>10.1%}")
    base_rate = summary["power_of_two"]["hit_rate"]
    if base_rate:
        ratio = summary["prefix_affinity"]["hit_rate"] / base_rate
        print(f"affinity / power-of-two hit rate: {ratio:.2f}x")
    report = {
        "config": vars(args),
        "loadavg_at_end": os.getloadavg(),
        "results": summary,
        "runs": results,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
