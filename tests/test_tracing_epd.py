"""One image chat through the encode -> prefill -> decode app, traced end to end.

The app (configs/serve/epd.yaml's shape: ingress, PD router, one VisionEncoder, one prefill and
one decode replica, KV over NIXL) runs on the shared cluster with tracing to a JSON-lines file.
The official OpenAI client sends an image chat with a W3C ``traceparent``; the test reads the
spans back and checks them against values it fixes or computes itself: the client's trace and
parent ids, the span tree (names, parents, the process role that wrote each), the time nesting
inside the root, the KV bytes from the model's config and the prompt length the response
reports, and the encoder's cache: the first request encodes the image (queue and compute
spans), a second one with the same image is a cache hit (neither).
"""

from __future__ import annotations

import base64
import io
import json
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.ray

openai = pytest.importorskip("openai")
pytest.importorskip("ray")
from conftest import busy_engines  # noqa: E402
from PIL import Image  # noqa: E402

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
ROOT = "POST /epdtrace/v1/chat/completions"

# name -> (parent's name, role of the process that records it)
EPD_TREE = {
    ROOT: (None, "ingress"),
    "ingress.validate": (ROOT, "ingress"),
    "ingress.chat_template": (ROOT, "ingress"),
    "ingress.detokenize_stream": (ROOT, "ingress"),
    "encoder": (ROOT, "router"),
    "route.encoder": ("encoder", "router"),
    "vision_encoder": ("encoder", "encoder"),
    "encoder.queue": ("vision_encoder", "encoder"),
    "encoder.compute": ("vision_encoder", "encoder"),
    "pd_router": (ROOT, "router"),
    "route.prefill": ("pd_router", "router"),
    "prefill": ("pd_router", "prefill"),
    "prefill.queue": ("prefill", "prefill"),
    "prefill.compute": ("prefill", "prefill"),
    "kv.export": ("prefill", "prefill"),
    "route.decode": ("pd_router", "router"),
    "decode": ("pd_router", "decode"),
    "kv.transfer": ("decode", "decode"),
    "decode.queue": ("decode", "decode"),
    "decode.compute": ("decode", "decode"),
}


def png(seed: int, size: tuple[int, int] = (40, 30)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def image_chat(image: bytes) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in this picture?"},
            ],
        }
    ]


@pytest.fixture(scope="module")
def traced_epd(serve_cluster, tiny_llava_path, tmp_path_factory):
    """The EPD app over the tiny LLaVA, every request traced to a JSON-lines file."""
    from ray import serve

    from app.builder import BuildArgs, build_openai_app

    path = tmp_path_factory.mktemp("traces") / "traces.jsonl"
    small = {"ray_actor_options": {"num_cpus": 0.05}}
    app = build_openai_app(
        BuildArgs(
            mode="disaggregated",
            model=str(tiny_llava_path),
            served_model_name="tiny-llava",
            max_model_len=512,
            embedding_model=None,
            max_body_bytes=1 << 22,
            engine_args={"num_kv_blocks": 64},
            multimodal={"encoder": "separate"},
            tracing={"enabled": True, "file": str(path), "export_interval_s": 0.2},
        ),
        prefill_options=small,
        decode_options=small,
        ingress_options=small,
        encoder_options=small,
    )
    serve.run(app, name="epdtrace", route_prefix="/epdtrace")
    try:
        yield serve_cluster, path
    finally:
        serve.delete("epdtrace")


def spans_of(path: Path, trace_id: str, names: set[str], timeout_s: float = 30.0) -> list[dict]:
    """The trace's spans once every name in ``names`` was written (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = []
        if path.exists():
            lines = path.read_text().splitlines()
            spans = [s for s in map(json.loads, lines) if s["trace_id"] == trace_id]
        if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def chat(base: str, image: bytes, trace_id: str):
    client = openai.OpenAI(
        base_url=f"{base}/epdtrace/v1", api_key="unused", max_retries=0, timeout=120
    )
    return client.chat.completions.create(
        model="tiny-llava",
        messages=image_chat(image),
        max_tokens=5,
        temperature=0.0,
        extra_body={"ignore_eos": True},
        extra_headers={"traceparent": f"00-{trace_id}-{PARENT_ID}-01"},
    )


def kv_bytes_per_token(model_path: Path) -> int:
    """K and V of every layer for one token, fp32, from the checkpoint's own config."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model_path).text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * 4


def assert_idle() -> None:
    from ray import serve

    deadline = time.monotonic() + 30
    while True:
        stats = [
            serve.get_deployment_handle(name, app_name="epdtrace").stats.remote().result()
            for name in ("PrefillServer", "DecodeServer")
        ]
        encoder = serve.get_deployment_handle("VisionEncoder", app_name="epdtrace")
        pending = encoder.stats.remote().result()["num_pending"]
        if not busy_engines(stats) and not pending:
            return
        assert time.monotonic() < deadline, f"not idle: {stats}, {pending} images pending"
        time.sleep(0.3)


def test_image_chat_is_one_trace_across_encoder_prefill_and_decode(traced_epd, tiny_llava_path):
    base, path = traced_epd
    image = png(7)
    response = chat(base, image, TRACE_ID)
    assert response.usage.completion_tokens == 5

    spans = spans_of(path, TRACE_ID, set(EPD_TREE))
    named = {s["name"]: s for s in spans}
    assert set(EPD_TREE) <= set(named), f"missing {set(EPD_TREE) - set(named)}"
    assert len(named) == len(spans), "one span per name for one request with one image"

    ids = {s["span_id"]: s for s in spans}
    root = named[ROOT]
    assert root["parent_span_id"] == PARENT_ID and root["kind"] == "SERVER"
    for name, (parent, role) in EPD_TREE.items():
        span = named[name]
        assert span["trace_id"] == TRACE_ID, name
        if parent is not None:
            assert ids[span["parent_span_id"]]["name"] == parent, name
        assert span["role"] == role, name
        # Inside the root's time (one host, one clock; 5 ms for stamp conversions).
        assert span["start_time_unix_nano"] >= root["start_time_unix_nano"] - 5_000_000, name
        assert span["end_time_unix_nano"] <= root["end_time_unix_nano"] + 5_000_000, name
        assert span["end_time_unix_nano"] >= span["start_time_unix_nano"], name
    # Five processes wrote it: ingress, PD router, vision encoder, prefill and decode replicas.
    assert {s["role"] for s in spans} == {"ingress", "router", "encoder", "prefill", "decode"}
    assert len({s["process"] for s in spans}) == 5

    # The encoder: a miss on this replica, queue then compute, inside its replica span, and
    # the image encoded before the prefill replica got the request.
    encoder, replica = named["encoder"], named["vision_encoder"]
    assert encoder["attributes"]["neuron_serve.encoder.cache_hit"] is False
    assert replica["attributes"]["neuron_serve.encoder.cache_hit"] is False
    assert (
        replica["attributes"]["neuron_serve.encoder.replica"]
        == encoder["attributes"]["neuron_serve.encoder.replica"]
        == named["route.encoder"]["attributes"]["neuron_serve.route.replica"]
    )
    queue, compute = named["encoder.queue"], named["encoder.compute"]
    assert queue["end_time_unix_nano"] == compute["start_time_unix_nano"]
    for child in (queue, compute):
        assert child["start_time_unix_nano"] >= replica["start_time_unix_nano"]
        assert child["end_time_unix_nano"] <= replica["end_time_unix_nano"] + 1_000_000
    assert encoder["end_time_unix_nano"] <= named["prefill"]["start_time_unix_nano"]

    # The KV handoff: NIXL on both sides; the exported bytes are whole 16-token blocks of
    # the prompt (image tokens included, as the response's usage counts them).
    export, transfer = named["kv.export"]["attributes"], named["kv.transfer"]["attributes"]
    assert export["neuron_serve.kv.transport"] == transfer["neuron_serve.kv.transport"] == "nixl"
    assert export["neuron_serve.kv.failed"] is False and transfer["neuron_serve.kv.failed"] is False
    prompt = response.usage.prompt_tokens
    blocks = {-(-prompt // 16), -(-(prompt + 1) // 16)}
    per_block = 16 * kv_bytes_per_token(tiny_llava_path)
    assert export["neuron_serve.kv.num_bytes"] in {b * per_block for b in blocks}
    assert transfer["neuron_serve.kv.num_bytes"] == export["neuron_serve.kv.num_bytes"]
    assert root["attributes"]["gen_ai.usage.input_tokens"] == prompt
    assert root["attributes"]["gen_ai.usage.output_tokens"] == 5

    # The same image again: the encoder's cache holds it; no queue or compute span.
    again = "1" * 32
    assert chat(base, image, again).usage.completion_tokens == 5
    # Every process exports on its own timer: wait for each span a cache hit writes.
    hit_tree = set(EPD_TREE) - {"encoder.queue", "encoder.compute"}
    spans = spans_of(path, again, hit_tree)
    named = {s["name"]: s for s in spans}
    assert hit_tree <= set(named), f"missing {hit_tree - set(named)}"
    assert named["encoder"]["attributes"]["neuron_serve.encoder.cache_hit"] is True
    assert named["vision_encoder"]["attributes"]["neuron_serve.encoder.cache_hit"] is True
    assert not {"encoder.queue", "encoder.compute"} & set(named)
    assert_idle()
