"""Image chat benchmark: the vision encoder as its own deployment vs inside the prefill replica.

One local cluster (127.0.0.1) runs, on the same LLaVA folder (default: the tiny random-weight
``tiny-llava``):
  separate  PDRouter -> VisionEncoder (1 replica) -> PrefillServer -> DecodeServer
  inline    PDRouter -> PrefillServer (encodes its own images) -> DecodeServer
Each round sends the same image chats to both in turn (A B A B ...): every request carries
images never seen before (so caches do not help), streams ``--output-len`` tokens, and its TTFT
(first streamed text) is recorded. Then the encoder alone: distinct images sent straight to
the VisionEncoder deployment at ``--encoder-concurrency``, with 1 and then 2 replicas, gives
images/s and its scaling.

    python bench/multimodal.py --num-requests 12 --concurrency 4 --rounds 2

Images are random-noise PNGs of ``--image-size`` (decoded, resized and cropped by the encoder
like real photos). With the tiny model the vision tower is small, so decode + preprocessing
weigh more than they would with CLIP ViT-L; the figures are ratios on a shared 2-vCPU box.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
from local_cluster import start_local_serve, stop_local_serve
from PIL import Image


def make_png(seed: int, size: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size, size * 4 // 3, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def chat(seed: int, args: argparse.Namespace) -> list[dict]:
    parts = [
        {
            "type": "image_url",
            "image_url": {
                "url": "data:image/png;base64,"
                + base64.b64encode(make_png(seed * 16 + i, args.image_size)).decode()
            },
        }
        for i in range(args.images_per_request)
    ]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe this."}]}]


async def one_chat(client, url: str, args: argparse.Namespace, messages: list[dict]) -> float:  # noqa: ANN001
    """Streams one chat; returns its TTFT in seconds."""
    body = {
        "model": args.model,
        "messages": messages,
        "max_tokens": args.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                choices = json.loads(line[len("data: ") :])["choices"]
                if any(c["delta"].get("content") for c in choices):
                    ttft = time.perf_counter() - start
    return ttft if ttft is not None else time.perf_counter() - start


async def load(send, items: list, concurrency: int) -> tuple[list, float]:  # noqa: ANN001
    queue = list(items)
    results: list = []

    async def worker() -> None:
        while queue:
            results.append(await send(queue.pop(0)))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def start(args: argparse.Namespace) -> str:
    port = start_local_serve()
    for name in ("separate", "inline"):
        deploy(args, name, encoder_replicas=1)
    return f"http://127.0.0.1:{port}"


def deploy(args: argparse.Namespace, encoder: str, encoder_replicas: int) -> None:
    """(Re)deploys the app named after its ``multimodal.encoder`` setting."""
    from ray import serve

    from app.builder import BuildArgs, build_openai_app

    build = BuildArgs(
        mode="disaggregated",
        model=args.model,
        max_model_len=args.max_model_len,
        embedding_model=None,
        max_body_bytes=64 << 20,
        multimodal={"encoder": encoder},
    )
    small = {"ray_actor_options": {"num_cpus": 0.1}}
    app = build_openai_app(
        build,
        prefill_options=small,
        decode_options=small,
        ingress_options=small,
        encoder_options={"num_replicas": encoder_replicas, **small},
    )
    serve.run(app, name=encoder, route_prefix=f"/{encoder}")


async def chat_rounds(base: str, args: argparse.Namespace) -> dict[str, list[float]]:
    import httpx

    ttfts: dict[str, list[float]] = {"separate": [], "inline": []}
    seed = 1000
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        for name in ttfts:  # warm-up: first-call costs (model pages, jit paths)
            await one_chat(client, f"{base}/{name}", args, chat(seed, args))
            seed += 1
        for _ in range(args.rounds):
            for name in ttfts:
                chats = [chat(seed + i, args) for i in range(args.num_requests)]
                seed += args.num_requests
                got, _ = await load(
                    lambda m, u=f"{base}/{name}": one_chat(client, u, args, m),
                    chats,
                    args.concurrency,
                )
                ttfts[name].extend(got)
    return ttfts


async def encoder_scaling(args: argparse.Namespace) -> dict[int, float]:
    """Images/s straight through the VisionEncoder deployment of ``separate``, 1 then 2
    replicas (the same distinct images for both)."""
    from ray import serve

    from deployments.protocol import EncodeRequest
    from neuron_runtime.multimodal import image_content_hash

    rates = {}
    for replicas in (1, 2):
        if replicas > 1:
            deploy(args, "separate", replicas)
        handle = serve.get_deployment_handle("VisionEncoder", app_name="separate")
        images = [
            make_png(50_000 + replicas * 1000 + i, args.image_size)
            for i in range(args.encoder_images)
        ]

        async def send(data: bytes, h=handle) -> None:  # noqa: ANN001
            await h.encode.remote(EncodeRequest(image_content_hash(data), data))

        await send(make_png(99_999 + replicas, args.image_size))  # warm-up
        _, seconds = await load(send, images, args.encoder_concurrency)
        rates[replicas] = len(images) / seconds
    return rates


def summary(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    return {
        "n": len(ms),
        "mean_ms": statistics.fmean(ms),
        "p50_ms": statistics.median(ms),
        "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llava")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-requests", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--images-per-request", type=int, default=1)
    parser.add_argument("--image-size", type=int, default=480, help="image height in pixels")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--encoder-images", type=int, default=48)
    parser.add_argument("--encoder-concurrency", type=int, default=8)
    parser.add_argument("--max-duration-s", type=float, default=900.0)
    parser.add_argument("--json", default="bench/results/multimodal.json")
    args = parser.parse_args()

    base = start(args)
    try:

        async def run() -> tuple[dict, dict]:
            ttfts = await chat_rounds(base, args)
            return ttfts, await encoder_scaling(args)

        ttfts, rates = asyncio.run(asyncio.wait_for(run(), args.max_duration_s))
    finally:
        stop_local_serve()
    rows = {name: summary(values) for name, values in ttfts.items()}
    print(f"{'TTFT':<10}{'n':>5}{'mean ms':>10}{'p50 ms':>10}{'p90 ms':>10}")
    for name, row in rows.items():
        print(
            f"{name:<10}{row['n']:>5}{row['mean_ms']:>10.1f}{row['p50_ms']:>10.1f}{row['p90_ms']:>10.1f}"
        )
    ratio = rows["separate"]["p50_ms"] / rows["inline"]["p50_ms"]
    print(f"TTFT p50 separate / inline: {ratio:.2f}")
    print(
        f"encoder: 1 replica {rates[1]:.1f} images/s, 2 replicas {rates[2]:.1f} images/s "
        f"({rates[2] / rates[1]:.2f}x)"
    )
    report = {
        "config": vars(args),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_at_end": os.getloadavg(),
        },
        "ttft": rows,
        "ttft_p50_separate_over_inline": ratio,
        "encoder_images_per_s": rates,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
