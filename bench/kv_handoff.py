"""The KV handoff from a prefill to a decode replica, per transport, at several prompt lengths.

Two parts, one local cluster (127.0.0.1), the default model (SmolLM2-135M: 30 layers x 3 KV
heads x 64, 720 KiB of KV per 16-token block):

1. Components, between two Ray actors that each own an engine and both transports (no Serve):
   per request, the prefill side's export (nixl: the ticket; object_store: the copy out of
   the blocks and ``ray.put``), the transfer (nixl: ticket -> the decode blocks filled: the
   receive, the handover to the reader thread, its READs (one of every layer for a whole
   read, the default over UCX; one per layer for a layer-wise one), and the time in their
   posting calls, where cross-memory attach copies; the actor waits on the read's
   progress as the engine's forward does; object_store: the ref read on the decode side)
   and the import (object_store: the array written into the decode blocks; nixl has none:
   the READ lands in them). A plain memory copy of the same bytes in the decode actor (best
   of three, warm) is the bandwidth reference; one READ of every layer posted inline on the
   actor's thread just before the engine's read is the transport's own ceiling.
2. The second token without Serve, per prompt in turn: one engine's decode step after its
   first token (colocated) against each transport's path on the decode actor after the
   prefill actor's export: the Ray hop, the receive (the peer loaded once), then nixl: the
   wait for the engine to start the read, the read, and the read with the decode engine's
   first step (they overlap: each layer waits only for its own blocks); object_store: the
   payload's import and the first step; nixl-whole: the same read waited for whole before
   the first step (no overlap). ``vs colocated`` is total / the colocated step.
3. End to end, the colocated app and the disaggregated app over each transport, loaded in
   turn (A B C A B C ...): TTFT, TPOT and the second token's latency, p50 / p99, and each
   app's second token p50 over the colocated app's TPOT p50 (``--apps`` picks apps).

    python bench/kv_handoff.py --prompt-lens 128,1024,4096 --requests 4 --output-len 16
    python bench/kv_handoff.py --parts components,second     # without the Serve apps

Prints tables and writes bench/results/kv_handoff.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from local_cluster import start_local_serve, stop_local_serve  # noqa: E402
from serve import handoff_figures, http_request, load_session, summarize  # noqa: E402
from serve import metrics_text as serve_metrics_text  # noqa: E402

MODEL = "smollm2-135m-instruct"
# The second token's paths: nixl-whole is a NIXL read the request waits for whole before its
# first step (no layer-wise overlap), for comparison.
SECOND = ("nixl", "nixl-whole", "object_store")
# The end-to-end apps: mode, transport, layer-wise reads (None: by backend), decode first.
APPS = {
    "colocated": ("colocated", "object_store", None, False),
    "pd-object_store": ("disaggregated", "object_store", None, False),
    # The default: decode call opened first, the handoff delivered to it by the prefill
    # replica; over UCX, whole reads.
    "pd-nixl": ("disaggregated", "nixl", None, True),
    # The handoff back through the router, which then opens the decode call.
    "pd-nixl-via-router": ("disaggregated", "nixl", None, False),
    "pd-nixl-layer-wise": ("disaggregated", "nixl", True, True),
}


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(length)]


def make_side(num_blocks: int | None, max_model_len: int, threads: int):  # noqa: ANN201 - an actor class
    import ray

    @ray.remote(num_cpus=0.5)
    class Side:
        """One engine (the prefill or the decode role) with both transports attached."""

        def __init__(self) -> None:
            import torch

            from deployments.kv_transport import KVTransportConfig, make_transport
            from neuron_runtime import EngineArgs, LLMEngine

            torch.set_num_threads(1)
            # The default KV budget (512 MiB here): the cache regions as large as a replica's.
            args = EngineArgs(
                model=MODEL,
                max_model_len=max_model_len,
                num_kv_blocks=num_blocks,
                enable_prefix_caching=False,
                num_threads=threads,
            )
            self.engine = LLMEngine.from_engine_args(args)
            self.transports = {}
            for name in ("nixl", "object_store"):
                transport = make_transport(KVTransportConfig(name))
                transport.attach(self.engine, self.engine.release_kv)
                self.transports[name] = transport

        async def prefill(self, transport: str, prompt: list[int]):  # noqa: ANN201
            from neuron_runtime import RequestOutputKind, SamplingParams

            params = SamplingParams(temperature=0, max_tokens=2)
            self.engine.add_request(
                "p", prompt, params, RequestOutputKind.FINAL_ONLY, export_kv=True
            )
            handoff = None
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    handoff = out.kv_handoff or handoff
            start = time.perf_counter()
            handoff = self.transports[transport].export(handoff)
            return handoff, time.perf_counter() - start, time.time()

        async def colocated(self, prompt: list[int]) -> float:
            """One engine doing it all: the time from the first token's output to the second's
            (the colocated app's TPOT at this prompt length, without Serve)."""
            from neuron_runtime import RequestOutputKind, SamplingParams

            params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            self.engine.add_request("c", prompt, params, RequestOutputKind.DELTA)
            times = []
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.outputs[0].token_ids:
                        times.append(time.perf_counter())
            return times[1] - times[0]

        async def second_token(  # noqa: ANN201
            self,
            transport: str,
            handoff,  # noqa: ANN001
            prompt: list[int],
            sent: float,
            overlap: bool = True,
        ):
            """The decode replica's path after the prefill replica's export: the ticket's
            arrival, the receive, the engine's read (or payload import), its first decode
            step; wall-clock times relative to ``sent`` (time.time() at export). Without
            ``overlap`` a block read completes before the request's first step (as a read
            that is not layer-wise)."""
            import dataclasses

            from neuron_runtime import RequestOutputKind, SamplingParams
            from neuron_runtime.kv_transfer import KVBlockSource

            arrived = time.time()
            start = time.perf_counter()
            kv = await self.transports[transport].receive(handoff, 30.0)
            received = time.perf_counter()
            if isinstance(kv, KVBlockSource):
                kv.layer_wise = overlap
            params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            self.engine.add_request(
                "d",
                prompt,
                params,
                RequestOutputKind.DELTA,
                handoff=dataclasses.replace(handoff, kv=kv),
            )
            out_at = None
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.outputs[0].token_ids:
                        out_at = time.perf_counter()
            row = {
                "hop_ms": (arrived - sent) * 1e3,
                "receive_ms": (received - start) * 1e3,
                "total_ms": (arrived - sent) * 1e3 + (out_at - start) * 1e3,
            }
            if isinstance(kv, KVBlockSource):
                row["until_read_ms"] = (kv.started_at - received) * 1e3
                row["read_ms"] = (kv.done_at - kv.started_at) * 1e3
                # The read and the first decode step overlap: from the read's start to the token.
                row["read_and_step_ms"] = (out_at - kv.started_at) * 1e3
            else:
                row["import_and_step_ms"] = (out_at - received) * 1e3
            return row

        async def held_blocks(self) -> int:
            return self.engine.stats().num_kv_blocks_held

        def inline_read(self, kv, blocks: list[int]) -> float:  # noqa: ANN001
            """The transport's ceiling: the same blocks in one READ over every layer, posted
            and waited for on this thread (no notification: the engine's read follows)."""
            from deployments.nixl_transport import layer_cells

            transport = self.transports["nixl"]
            layout, link = transport.layout, kv.link
            local = layer_cells(layout, layout.num_blocks, blocks).reshape(-1)
            remote = layer_cells(kv.layout, link.info.layout.num_blocks, kv.handoff.block_ids)
            before = time.perf_counter()
            handle = transport.post(link, local, remote.reshape(-1))
            while transport.state(handle) == "PROC":
                pass
            seconds = time.perf_counter() - before
            transport.finish(handle)
            return seconds

        async def receive(self, transport: str, handoff) -> dict:  # noqa: ANN001
            """Ticket -> KV in this engine's blocks; the times of each part."""
            import torch

            from neuron_runtime.kv_transfer import KVPayload

            engine = self.engine
            num_blocks = len(handoff.block_ids)
            # In id order, as the engine's scheduler puts them into a block table.
            blocks = sorted(b.block_id for b in engine.kv.pool.allocate(num_blocks))
            start = time.perf_counter()
            kv = await self.transports[transport].receive(handoff, 30.0)
            received = time.perf_counter()
            out = {"bytes": handoff.num_kv_bytes}
            if isinstance(kv, KVPayload):
                out["transfer_s"] = received - start
                before = time.perf_counter()
                engine.runner.import_kv(blocks, kv)
                out["import_s"] = time.perf_counter() - before
            else:
                # Before the engine's read (whose notification lets the prefill side free
                # the blocks), and not counted in the transfer: both sides' pages are then
                # as warm for the read as the memcpy reference's.
                out["inline_s"] = self.inline_read(kv, blocks)
                kv.start(blocks)
                # Waited for as the engine's forward waits for a layer: on the read's
                # progress, woken when the reader thread counts the last layer in.
                last = kv.layout.num_layers - 1
                while not kv.poll():
                    if not kv.wait_layer(last):
                        time.sleep(0.0002)
                out["read_s"] = kv.done_at - kv.started_at
                out["receive_s"] = received - start
                out["transfer_s"] = out["receive_s"] + out["read_s"]
                out["queue_s"] = kv.picked_at - kv.started_at
                out["post_s"] = kv.post_s
                out["import_s"] = 0.0
            engine.kv.pool.free(blocks)
            # The reference: one contiguous copy of as many bytes, in this process.
            src = torch.ones(handoff.num_kv_bytes // 4)
            dst = torch.zeros_like(src)  # touched: the copy does not page-fault
            best = float("inf")
            for _ in range(3):
                before = time.perf_counter()
                dst.copy_(src)
                best = min(best, time.perf_counter() - before)
            out["memcpy_s"] = best
            return out

    return Side


def components(args: argparse.Namespace, lengths: list[int]) -> dict:
    import ray

    side = make_side(None, max(lengths) + 64, args.threads)
    prefill, decode = side.remote(), side.remote()
    rng = random.Random(0)
    rows: dict = {}
    for length in lengths:
        for transport in ("nixl", "object_store"):
            samples = []
            for _ in range(args.requests):
                handoff, export_s, _ = ray.get(
                    prefill.prefill.remote(transport, random_prompt(rng, length))
                )
                got = ray.get(decode.receive.remote(transport, handoff))
                got["export_s"] = export_s
                samples.append(got)
                deadline = time.monotonic() + 10
                while ray.get(prefill.held_blocks.remote()):  # freed by the READ's notification
                    assert time.monotonic() < deadline, "prefill blocks still held"
                    time.sleep(0.005)
            rows[f"{length}/{transport}"] = aggregate(samples)
            print_component(length, transport, rows[f"{length}/{transport}"])
    ray.kill(prefill)
    ray.kill(decode)
    return rows


def second_token(args: argparse.Namespace, lengths: list[int]) -> dict:
    """The second token without Serve: colocated (one engine's decode step after the first
    token) against each transport (export -> Ray hop -> receive -> read or import -> the
    decode engine's first step), in turn per prompt, the stages of each."""
    import ray

    side = make_side(None, max(lengths) + 64, args.threads)
    prefill, decode = side.remote(), side.remote()
    rng = random.Random(2)
    rows: dict = {}

    def handed_off(name: str, prompt: list[int]) -> dict:
        transport = name.removesuffix("-whole")
        handoff, _, sent = ray.get(prefill.prefill.remote(transport, prompt))
        overlap = not name.endswith("-whole")
        row = ray.get(decode.second_token.remote(transport, handoff, prompt, sent, overlap))
        deadline = time.monotonic() + 10
        while ray.get(prefill.held_blocks.remote()):
            assert time.monotonic() < deadline, "prefill blocks still held"
            time.sleep(0.005)
        return row

    for transport in ("nixl", "object_store"):  # warm-up: the peer's agent loaded, connected
        handed_off(transport, random_prompt(rng, 32))
    for length in lengths:
        samples: dict[str, list[dict]] = {"colocated": [], **{name: [] for name in SECOND}}
        for _ in range(args.requests):
            prompt = random_prompt(rng, length)
            ms = ray.get(decode.colocated.remote(prompt)) * 1e3
            samples["colocated"].append({"total_ms": ms, "step_ms": ms})
            for transport in SECOND:
                row = handed_off(transport, prompt)
                row["vs_colocated"] = row["total_ms"] / ms
                samples[transport].append(row)
        for name, values in samples.items():
            row = {k: statistics.median(v[k] for v in values) for k in values[0]}
            row["n"] = len(values)
            rows[f"{length}/{name}"] = row
            stages = "  ".join(f"{k[:-3]} {v:.1f}" for k, v in row.items() if k.endswith("_ms"))
            ratio = f"  vs colocated {row['vs_colocated']:.2f}" if "vs_colocated" in row else ""
            print(f"{length:>5} tok {name:<12} {stages} ms{ratio}", flush=True)
    ray.kill(prefill)
    ray.kill(decode)
    return rows


def aggregate(samples: list[dict]) -> dict:
    out: dict = {"bytes": samples[0]["bytes"], "n": len(samples)}
    for key in (
        "export_s",
        "transfer_s",
        "import_s",
        "read_s",
        "receive_s",
        "queue_s",
        "post_s",
        "inline_s",
        "memcpy_s",
    ):
        values = [s[key] for s in samples if key in s]
        if values:
            out[key.replace("_s", "_ms")] = statistics.median(values) * 1e3
    out["transfer_gbps"] = out["bytes"] / out["transfer_ms"] / 1e6
    out["memcpy_gbps"] = out["bytes"] / out["memcpy_ms"] / 1e6
    out["transfer_vs_memcpy"] = out["transfer_gbps"] / out["memcpy_gbps"]
    return out


def print_component(length: int, transport: str, row: dict) -> None:
    read = ""
    if "read_ms" in row:
        read = (
            f" (receive {row['receive_ms']:.2f}, to the reader {row['queue_ms']:.2f}, "
            f"READs {row['read_ms']:.2f} of which posting {row['post_ms']:.2f}; one READ "
            f"inline {row['inline_ms']:.2f} = {row['bytes'] / row['inline_ms'] / 1e6:.2f} GB/s)"
        )
    print(
        f"{length:>5} tok {transport:<12} {row['bytes'] / 2**20:7.1f} MiB  "
        f"export {row['export_ms']:7.3f} ms  transfer {row['transfer_ms']:7.2f} ms{read}  "
        f"import {row['import_ms']:6.2f} ms  | {row['transfer_gbps']:.2f} GB/s vs memcpy "
        f"{row['memcpy_gbps']:.2f} GB/s ({row['transfer_vs_memcpy']:.0%})",
        flush=True,
    )


def end_to_end(args: argparse.Namespace, lengths: list[int], port: int) -> dict:
    from ray import serve

    from app.builder import BuildArgs, DisaggregationArgs, build_openai_app

    small = {"ray_actor_options": {"num_cpus": 0.1}}
    engine_args = {"num_kv_blocks": -(-max(lengths) // 16) * 2 + 16, "enable_prefix_caching": False}
    urls = {}
    apps = args.apps.split(",")
    unknown = set(apps) - set(APPS)
    if unknown or "colocated" not in apps:
        raise SystemExit(f"--apps: choose from {sorted(APPS)}, colocated included")
    for name in apps:
        mode, transport, layer_wise, decode_first = APPS[name]
        build = BuildArgs(
            mode=mode,
            max_model_len=max(lengths) + args.output_len + 16,
            embedding_model=None,
            engine_args=engine_args,
            disaggregation=DisaggregationArgs(
                kv_transport=transport,
                kv_read_layer_wise=layer_wise,
                kv_decode_first=decode_first,
            ),
        )
        app = build_openai_app(
            build,
            llm_options=small,
            prefill_options=small,
            decode_options=small,
            ingress_options=small,
        )
        serve.run(app, name=name, route_prefix=f"/{name}")
        urls[name] = f"http://127.0.0.1:{port}/{name}/v1/completions"
    rng = random.Random(1)
    rows: dict = {}

    async def load() -> None:
        async with load_session() as client:
            for length in lengths:
                results: dict[str, list] = {name: [] for name in apps}
                prompts = [random_prompt(rng, length) for _ in range(args.requests)]
                for name in apps:  # warm-up: connections, first transfers
                    await http_request(client, urls[name], MODEL, prompts[0][:32], 4)
                before = {name: await metrics_text(client, urls[name]) for name in apps}
                for prompt in prompts:
                    for name in apps:
                        results[name].append(
                            await http_request(client, urls[name], MODEL, prompt, args.output_len)
                        )
                for name in apps:
                    after = await metrics_text(client, urls[name])
                    done = results[name]
                    summary = summarize(done, 1.0, {})
                    second = [r.itl[0] for r in done if r.ok and r.itl]
                    summary["second_token"] = {
                        "p50_ms": statistics.median(second) * 1e3 if second else None,
                        "p99_ms": max(second) * 1e3 if second else None,
                    }
                    # The prefill side's handoff per request (nixl: the ticket and, decode
                    # first, the delivery) and the decode side's import (ticket in to blocks
                    # in: decode first, what the first token waits for besides a hop), from
                    # the app's kv_transfer_seconds histogram.
                    figures = list(handoff_figures(before[name], after, {}).values())
                    for stage in ("export", "import"):
                        summary[f"{stage}_ms"] = next(
                            (f[f"{stage}_mean_ms"] for f in figures), None
                        )
                    rows[f"{length}/{name}"] = summary
                    print_e2e(length, name, summary)
                colocated = rows.get(f"{length}/colocated")
                for figure, over, label in (
                    ("second_token", "tpot", "2nd token p50 / colocated TPOT p50"),
                    ("ttft", "ttft", "TTFT p50 / colocated TTFT p50"),
                ):
                    base = colocated[over]["p50_ms"] if colocated else None
                    ratios = []
                    for name in apps:
                        value = rows[f"{length}/{name}"][figure]["p50_ms"]
                        if base and value is not None:
                            ratios.append(f"{name} {value / base:.3f}x")
                    print(f"{length:>5} tok {label}: " + ", ".join(ratios))

    asyncio.run(load())
    for name in apps:
        serve.delete(name)
    return rows


async def metrics_text(client, url: str) -> str:  # noqa: ANN001 - serve.load_session()
    """The /metrics text of the app whose completions URL is ``url``."""
    return await serve_metrics_text(client, url.replace("/v1/completions", "/metrics"))


def print_e2e(length: int, name: str, s: dict) -> None:
    def pair(key: str) -> str:
        p50, p99 = s[key]["p50_ms"], s[key]["p99_ms"]
        return "-" if p50 is None else f"{p50:7.1f} / {p99:7.1f}"

    print(
        f"{length:>5} tok {name:<16} ok {s['completed']}/{s['completed'] + s['failed']}  "
        f"TTFT {pair('ttft')}  TPOT {pair('tpot')}  2nd token {pair('second_token')} ms "
        f"(p50 / p99)"
        + "".join(
            f"  {stage} {s[f'{stage}_ms']:.2f} ms/request"
            for stage in ("export", "import")
            if s[f"{stage}_ms"] is not None
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-lens", default="128,1024,4096")
    parser.add_argument("--requests", type=int, default=4, help="per prompt length and app")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU kernel threads of each actor's engine"
    )
    parser.add_argument("--parts", default="components,second,e2e")
    parser.add_argument("--apps", default=",".join(APPS), help="end-to-end apps, in turn")
    parser.add_argument("--json", default="bench/results/kv_handoff.json")
    args = parser.parse_args()
    lengths = [int(x) for x in args.prompt_lens.split(",")]
    parts = args.parts.split(",")
    port = start_local_serve()
    result: dict = {"args": vars(args)}
    try:
        if "components" in parts:
            print("-- components: export (prefill side), transfer, import; medians", flush=True)
            result["components"] = components(args, lengths)
        if "second" in parts:
            print("-- second token without Serve: stages, medians", flush=True)
            result["second_token"] = second_token(args, lengths)
        if "e2e" in parts:
            print("-- end to end, one request at a time, apps in turn", flush=True)
            result["end_to_end"] = end_to_end(args, lengths, port)
    finally:
        stop_local_serve()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
