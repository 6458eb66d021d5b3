"""Image chats on a local Ray cluster: ingress -> PDRouter -> VisionEncoder -> prefill -> decode.

Applications on the shared cluster (conftest.serve_cluster), all on the tiny random-weight
LLaVA (configs/build_tiny_llava.py):
- ``epd`` (/epd): two VisionEncoder replicas (rendezvous routed), one prefill, one decode;
  a batch wait long enough (0.4 s) that a client can leave while its image is being encoded;
- ``pdinline`` (/pdinline): disaggregated, the prefill replica encodes images itself;
- ``mmcolo`` (/mmcolo): one colocated LLMServer encoding images itself.
References: the offline ``LLM.chat`` on the same folder and transformers'
``LlavaForConditionalGeneration`` (with its own processor and chat template).
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.ray

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
from conftest import busy_engines, metric  # noqa: E402
from PIL import Image  # noqa: E402
from ray import serve  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from neuron_runtime import LLM, SamplingParams  # noqa: E402
from neuron_runtime.model_store import resolve_model  # noqa: E402
from neuron_runtime.multimodal import image_content_hash  # noqa: E402
from router.policies import ReplicaLoad, rendezvous_rank  # noqa: E402

MODEL = "tiny-llava"
MAX_MODEL_LEN = 512
APPS = {"epd": 1, "pdinline": 1}  # disaggregated apps -> prefill replicas


def png(seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_chat(text: str, *images: bytes) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def mm_server(serve_cluster):
    from app.builder import BuildArgs, build_openai_app

    small = {"ray_actor_options": {"num_cpus": 0.1}}
    common = dict(model=MODEL, max_model_len=MAX_MODEL_LEN, embedding_model=None)
    epd = build_openai_app(
        BuildArgs(
            mode="disaggregated",
            multimodal={"encoder": "separate", "encoder_batch_wait_timeout_s": 0.4},
            **common,
        ),
        prefill_options=small,
        decode_options=small,
        ingress_options=small,
        encoder_options={"num_replicas": 2, **small},
    )
    inline = build_openai_app(
        BuildArgs(mode="disaggregated", multimodal={"encoder": "inline"}, **common),
        prefill_options=small,
        decode_options=small,
        ingress_options=small,
    )
    colo = build_openai_app(BuildArgs(**common), llm_options=small, ingress_options=small)
    serve.run(epd, name="epd", route_prefix="/epd")
    serve.run(inline, name="pdinline", route_prefix="/pdinline")
    serve.run(colo, name="mmcolo", route_prefix="/mmcolo")
    try:
        yield serve_cluster
    finally:
        for name in ("epd", "pdinline", "mmcolo"):
            serve.delete(name)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model=MODEL, max_model_len=MAX_MODEL_LEN)


def client(base: str, prefix: str):
    return openai.OpenAI(
        base_url=f"{base}{prefix}/v1", api_key="unused", max_retries=0, timeout=120
    )


def encoder_stats() -> dict[str, dict]:
    handle = serve.get_deployment_handle("VisionEncoder", app_name="epd")
    seen: dict[str, dict] = {}
    for _ in range(60):
        stats = handle.stats.remote().result(timeout_s=30)
        seen[stats["replica_id"]] = stats
        if len(seen) == 2:
            return seen
    raise AssertionError(f"saw {len(seen)} of 2 encoder replicas")


def engine_stats(deployment: str, app: str) -> dict:
    return serve.get_deployment_handle(deployment, app_name=app).stats.remote().result(timeout_s=30)


def wait_idle(app: str, timeout_s: float = 60.0) -> None:
    """Engines empty, the router holding no KV, no encoder with an image in flight."""
    deadline = time.monotonic() + timeout_s
    while True:
        names = ["PrefillServer", "DecodeServer"] if app in APPS else ["LLMServer"]
        stats = [engine_stats(name, app) for name in names]
        busy = busy_engines(stats)
        if app in APPS:
            router = serve.get_deployment_handle("PDRouter", app_name=app)
            refs = sum(s.get("num_kv_refs_held", 0) for s in router.stats.remote().result())
            busy += [{"router_kv_refs": refs}] if refs else []
        if app == "epd":
            busy += [s for s in encoder_stats().values() if s["num_pending"]]
        if not busy:
            return
        assert time.monotonic() < deadline, f"{app} not idle: {busy}"
        time.sleep(0.3)


def transformers_greedy(chat: list[dict], images: list[bytes], max_tokens: int) -> str:
    """transformers' own LLaVA on the same folder: its processor, template and generate."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = resolve_model(MODEL)
    processor = AutoProcessor.from_pretrained(path)
    model = LlavaForConditionalGeneration.from_pretrained(path, torch_dtype=torch.float32).eval()
    template_chat = [
        {
            "role": m["role"],
            "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]],
        }
        for m in chat
    ]
    text = processor.apply_chat_template(template_chat, add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(i)).convert("RGB") for i in images]
    inputs = processor(images=pil, text=text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
        )
    new = out[0, inputs["input_ids"].shape[1] :]
    return processor.tokenizer.decode(new, skip_special_tokens=True)


# -- correctness --------------------------------------------------------------------------


def test_image_chats_equal_across_epd_inline_colocated_offline_and_transformers(mm_server, offline):
    a, b = png(1), png(2, (90, 70))
    chats = [
        image_chat("What is in this picture?", a),
        image_chat("Compare the two pictures.", a, b),
        image_chat("Describe it.", b),
        [{"role": "user", "content": "No picture here, just text."}],
    ]
    lengths = [12, 10, 8, 9]

    def ask(prefix: str, i: int) -> str:
        reply = client(mm_server, prefix).chat.completions.create(
            model=MODEL,
            messages=chats[i],
            temperature=0,
            max_tokens=lengths[i],
            extra_body={"ignore_eos": True},
        )
        assert reply.usage.completion_tokens == lengths[i]
        return reply.choices[0].message.content

    results = {}
    with ThreadPoolExecutor(len(chats)) as pool:
        for prefix in ("/epd", "/pdinline", "/mmcolo"):
            results[prefix] = list(pool.map(lambda i, p=prefix: ask(p, i), range(len(chats))))
    expected = [
        offline.chat(chat, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        .outputs[0]
        .text
        for chat, n in zip(chats, lengths, strict=True)
    ]
    assert results["/epd"] == results["/pdinline"] == results["/mmcolo"] == expected
    assert expected[1] == transformers_greedy(chats[1], [a, b], lengths[1])
    for app in ("epd", "pdinline", "mmcolo"):
        wait_idle(app)


def test_streaming_image_chat_equals_offline(mm_server, offline):
    chat = image_chat("Tell me a story about this.", png(3))
    streamed = ""
    for chunk in client(mm_server, "/epd").chat.completions.create(
        model=MODEL,
        messages=chat,
        temperature=0,
        max_tokens=10,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        for choice in chunk.choices:
            streamed += choice.delta.content or ""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert streamed == offline.chat(chat, params)[0].outputs[0].text
    wait_idle("epd")


def test_a_repeated_image_hits_the_cache_of_the_replica_that_encoded_it(mm_server):
    image = png(11, (50, 50))
    key = image_content_hash(image)
    before = encoder_stats()
    ask = client(mm_server, "/epd").chat.completions.create
    ask(model=MODEL, messages=image_chat("First look.", image), max_tokens=2, temperature=0)
    middle = encoder_stats()
    encoded = [r for r in middle if middle[r]["num_encoded"] > before[r]["num_encoded"]]
    assert len(encoded) == 1, "one replica encodes the new image"
    owner = encoded[0]
    # The router's pick is the rendezvous owner of the image's hash.
    loads = [ReplicaLoad(replica_id=r) for r in middle]
    assert rendezvous_rank(key, loads)[0][0].replica_id == owner
    ask(model=MODEL, messages=image_chat("Second look.", image, image), max_tokens=2)
    after = encoder_stats()
    assert after[owner]["num_encoded"] == middle[owner]["num_encoded"]
    assert after[owner]["mm_cache_hits"] == middle[owner]["mm_cache_hits"] + 1
    other = next(r for r in after if r != owner)
    assert after[other]["mm_cache_queries"] == middle[other]["mm_cache_queries"]
    metrics = httpx.get(f"{mm_server}/epd/metrics", timeout=30).text
    assert metric(metrics, "vllm:mm_cache_hits_total") >= 1
    assert metric(metrics, "vllm:mm_cache_queries_total") >= 2
    assert metric(metrics, "neuron:encode_time_seconds_count") >= 1
    assert metric(metrics, "neuron:mm_embedding_bytes_total") > 0
    wait_idle("epd")


# -- bad input and faults -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}},
            "messages[0].content[0].image_url",
        ),
        (
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}},
            "messages[0].content[0].image_url",
        ),
        (
            {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
            "messages[0].content[0].image_url",
        ),
        (
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
            "messages[0].content[0]",
        ),
    ],
)
def test_bad_images_are_400_naming_the_part(mm_server, content, param):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [content, {"type": "text", "text": "Hi"}]}],
        "max_tokens": 2,
    }
    response = httpx.post(f"{mm_server}/epd/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    wait_idle("epd")


def test_too_many_images_and_spelled_placeholders_are_400(mm_server):
    url = f"{mm_server}/epd/v1/chat/completions"
    many = {"model": MODEL, "messages": image_chat("Hi", *[png(i) for i in range(9)])}
    response = httpx.post(url, json=many, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    spelled = {"model": MODEL, "messages": [{"role": "user", "content": "look: <image>"}]}
    response = httpx.post(url, json=spelled, timeout=30)
    assert response.status_code == 400, response.text
    # A completion has no images to fill a placeholder with, as text or as a token id.
    image_token_id = AutoConfig.from_pretrained(resolve_model(MODEL)).image_token_index
    for prompt in ("look: <image>", [5, image_token_id, 6]):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        response = httpx.post(f"{mm_server}/epd/v1/completions", json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt"
    wait_idle("epd")


def test_disconnect_while_encoding_frees_everything(mm_server):
    """The encoder batch waits 0.4 s for company: the client leaves inside that wait."""
    body = {
        "model": MODEL,
        "messages": image_chat("Leaving soon.", png(21)),
        "max_tokens": 50,
        "stream": True,
    }

    async def leave_early() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            with pytest.raises(asyncio.TimeoutError):
                async with asyncio.timeout(0.15):
                    async with http.stream(
                        "POST", f"{mm_server}/epd/v1/chat/completions", json=body
                    ) as response:
                        async for _ in response.aiter_bytes():
                            pass

    asyncio.run(leave_early())
    wait_idle("epd")
    # The service goes on serving the same image afterwards.
    reply = client(mm_server, "/epd").chat.completions.create(
        model=MODEL,
        messages=body["messages"],
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage.completion_tokens == 3
    wait_idle("epd")


def test_a_bad_image_in_an_encoder_batch_fails_only_its_own_request(mm_server):
    """Three images reach one encoder batch (it waits 0.4 s): a corrupt one among them gets
    its ValueError, the other two their features, equal to the offline vision encoder's."""
    from deployments.protocol import EncodeRequest
    from neuron_runtime.multimodal import VisionEncoder, load_image

    handle = serve.get_deployment_handle("VisionEncoder", app_name="epd")
    images = [png(31), b"\x89PNG\r\n\x1a\n" + b"\0" * 64, png(32)]
    # Keys the same replica owns, so the three meet in one batch there.
    loads = [ReplicaLoad(replica_id=r) for r in encoder_stats()]

    def owner(key: str) -> str:
        return rendezvous_rank(key, loads)[0][0].replica_id

    candidates = [f"batch-test-{i}" for i in range(64)]
    keys = [k for k in candidates if owner(k) == owner(candidates[0])][:3]
    requests = [EncodeRequest(key, data) for key, data in zip(keys, images, strict=True)]
    responses = [handle.encode.remote(r) for r in requests]
    with pytest.raises(ValueError):
        responses[1].result(timeout_s=60)
    results = [responses[i].result(timeout_s=60) for i in (0, 2)]
    assert not any(r.cache_hit for r in results)
    assert results[0].encode_seconds == results[1].encode_seconds  # one batch
    reference = VisionEncoder.from_pretrained(resolve_model(MODEL))
    for result, data in zip(results, (images[0], images[2]), strict=True):
        features = ray.get(result.features)
        expected = reference.encode_images([load_image(data)])[0]
        np.testing.assert_allclose(features.embeds, expected, atol=1e-5)
        assert features.fingerprint == reference.fingerprint
    wait_idle("epd")


def test_embedding_cache_evicts_least_recently_used_by_bytes():
    from deployments.vision_encoder import EmbeddingCache

    cache = EmbeddingCache(max_bytes=100)
    refs = {key: object() for key in "abcd"}
    cache.put("a", refs["a"], 40)
    cache.put("b", refs["b"], 40)
    assert cache.get("a") == (refs["a"], 40)  # a is now the most recent
    cache.put("c", refs["c"], 40)  # over 100: b (least recent) goes
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.num_bytes == 80 and len(cache) == 2
    cache.put("d", refs["d"], 101)  # larger than the whole cache: not kept
    assert cache.get("d") is None and cache.num_bytes == 80
