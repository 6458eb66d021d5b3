"""Images through the engine, against transformers' LlavaForConditionalGeneration.

The reference for every greedy output is transformers' model given its own processor's
``input_ids`` and ``pixel_values`` (AutoProcessor of the tiny LLaVA folder). Blocks of 4
tokens and a budget of 7 tokens a step: prefills are chunked through the 16-token images,
chunks start mid-block and images mid-chunk.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image

from neuron_runtime import (
    LLM,
    AsyncEngine,
    EngineArgs,
    LLMEngine,
    RequestOutputKind,
    SamplingParams,
)
from neuron_runtime.kv_transfer import KVTransferError
from neuron_runtime.multimodal import (
    ImageFeatures,
    MultiModalInput,
    VisionEncoder,
    expand_image_tokens,
    hash_image,
)

NUM_TOKENS = 12
ENGINE_ARGS = dict(max_model_len=256, block_size=4, num_kv_blocks=512, max_num_batched_tokens=7)


def random_image(seed: int, width: int = 80, height: int = 64) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


A, B, C = random_image(0), random_image(1, 56, 90), random_image(2, 120, 60)


def greedy(max_tokens: int = NUM_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def hf(tiny_llava_path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_path, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # a fixed number of tokens
    return model.eval(), AutoProcessor.from_pretrained(tiny_llava_path)


def hf_inputs(hf, text: str, images: list[Image.Image]) -> dict:
    _, processor = hf
    return dict(processor(text=text, images=images or None, return_tensors="pt"))


def hf_greedy(hf, inputs: dict, max_new_tokens: int = NUM_TOKENS) -> list[int]:
    model, _ = hf
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="module")
def llm(tiny_llava_path) -> LLM:
    return LLM(model=str(tiny_llava_path), **ENGINE_ARGS)


def assert_idle(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_unfinished_outputs) == (0, 0, 0)
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
    assert not engine._handoffs


@pytest.fixture(autouse=True)
def idle_after(request):
    yield
    if "llm" in request.fixturenames:
        assert_idle(request.getfixturevalue("llm").engine)


PROMPTS = [
    ("Look at this picture: <image> What is in it?", [A]),
    ("<image> and <image>: which one is larger, and why?", [A, B]),
    ("Describe <image>", [C]),  # the prompt ends inside the image
    ("A question without any picture at all.", []),
]


def generate(llm: LLM, text: str, images: list[Image.Image], max_tokens: int = NUM_TOKENS):
    prompt: dict = {"prompt": text}
    if images:
        prompt["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
    return llm.generate(prompt, greedy(max_tokens))[0]


def test_mixed_batch_and_each_alone_match_transformers(llm, hf):
    prompts = []
    for text, images in PROMPTS:
        prompt: dict = {"prompt": text}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        prompts.append(prompt)
    batch = llm.generate(prompts, greedy())
    for (text, images), out in zip(PROMPTS, batch, strict=True):
        inputs = hf_inputs(hf, text, images)
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert out.outputs[0].token_ids == hf_greedy(hf, inputs), text
        assert generate(llm, text, images).outputs[0].token_ids == out.outputs[0].token_ids
    # Images change the answer (the comparison would be blind otherwise).
    assert batch[0].outputs[0].token_ids != generate(llm, PROMPTS[0][0], [B]).outputs[0].token_ids


def _data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_image_parts_matches_transformers(llm, hf):
    _, processor = hf
    question = {"type": "text", "text": "Which of these two is brighter?"}
    url_parts = [
        {"type": "image_url", "image_url": {"url": _data_url(A)}},
        {"type": "image", "image": B},
        question,
    ]
    out = llm.chat([{"role": "user", "content": url_parts}], greedy())[0]
    template_parts = [{"type": "image"}, {"type": "image"}, question]
    text = processor.apply_chat_template(
        [{"role": "user", "content": template_parts}], add_generation_prompt=True
    )
    inputs = hf_inputs(hf, text, [A, B])
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == hf_greedy(hf, inputs)


def test_prefix_cache_shares_kv_only_for_the_same_image(llm, hf):
    engine = llm.engine
    engine.kv.pool.reset_prefix_cache()
    text = "You are a careful observer of small pictures. Please look: <image> What is it?"
    image_offset = engine.tokenizer.encode(text).index(engine.vision.image_token_id)

    def run(image: Image.Image) -> tuple[list[int], int]:
        before = engine.stats().prefix_cache_hits
        out = generate(llm, text, [image])
        return out.outputs[0].token_ids, engine.stats().prefix_cache_hits - before

    with_a, hits = run(A)
    assert hits == 0
    with_b, hits = run(B)
    assert hits == image_offset // 4 * 4  # only the blocks of text before the image
    assert with_b == hf_greedy(hf, hf_inputs(hf, text, [B]))
    assert with_a != with_b
    again, hits = run(A)
    prompt_len = image_offset + 16 + len(engine.tokenizer.encode(" What is it?"))
    assert hits == (prompt_len - 1) // 4 * 4 > image_offset + 16
    assert again == with_a == hf_greedy(hf, hf_inputs(hf, text, [A]))


def test_a_prefix_hit_ending_inside_an_image(llm, hf):
    """The prompt ends with its image: a rerun hits all but the last block, which holds the
    image's last placeholders, so the recomputed chunk starts inside the image."""
    engine = llm.engine
    text = "Here is one more small picture to describe: <image>"
    first = generate(llm, text, [C]).outputs[0].token_ids
    before = engine.stats().prefix_cache_hits
    again = generate(llm, text, [C]).outputs[0].token_ids
    offset = engine.tokenizer.encode(text).index(engine.vision.image_token_id)
    hits = engine.stats().prefix_cache_hits - before
    assert offset < hits < offset + 16
    assert again == first == hf_greedy(hf, hf_inputs(hf, text, [C]))


def test_preemption_recomputes_the_image_rows(tiny_llava_path, hf):
    # 20 blocks of 4 tokens for three requests of ~45 tokens each: someone is preempted.
    llm = LLM(
        model=str(tiny_llava_path),
        max_model_len=64,
        block_size=4,
        num_kv_blocks=20,
        max_num_batched_tokens=7,
        enable_prefix_caching=False,
    )
    prompts = PROMPTS[:3]
    outs = llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in prompts], greedy(20)
    )
    assert llm.engine.stats().num_preemptions > 0
    for (text, images), out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, hf_inputs(hf, text, images), 20)
    assert_idle(llm.engine)


def _mm_request(engine: LLMEngine, text: str, images: list, encoder: VisionEncoder | None = None):
    """Expanded prompt ids and image inputs: raw images, or features from ``encoder``."""
    vision = engine.vision
    ids, spans = expand_image_tokens(
        engine.tokenizer.encode(text), vision.image_token_id, vision.tokens_per_image
    )
    mm = []
    for (offset, length), image in zip(spans, images, strict=True):
        content_hash = hash_image(image)
        if encoder is None:
            mm.append(MultiModalInput(offset, length, content_hash, image=image))
        else:
            (embeds,) = encoder.encode_images([image])
            features = ImageFeatures(content_hash, embeds, encoder.fingerprint)
            mm.append(MultiModalInput(offset, length, content_hash, features=features))
    return ids, mm


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], dict]], max_tokens=NUM_TOKENS):
    for request_id, ids, kwargs in requests:
        engine.add_request(
            request_id, ids, greedy(max_tokens), RequestOutputKind.FINAL_ONLY, **kwargs
        )
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
            if out.kv_handoff is not None:  # prefill role: copy the KV out, free its blocks
                out.kv_handoff.kv = engine.read_kv(out.kv_handoff)
                engine.release_kv(out.kv_handoff.handoff_id)
    assert_idle(engine)
    return final


@pytest.fixture(scope="module")
def encoder(tiny_llava_path) -> VisionEncoder:
    return VisionEncoder.from_pretrained(tiny_llava_path)


def test_precomputed_features_equal_engine_encoded(llm, encoder):
    engine = llm.engine
    assert encoder.fingerprint == engine.vision.fingerprint
    text, images = PROMPTS[1]
    ids, raw = _mm_request(engine, text, images)
    _, precomputed = _mm_request(engine, text, images, encoder)
    outs = _run(
        engine, [("raw", ids, {"mm_inputs": raw}), ("pre", ids, {"mm_inputs": precomputed})]
    )
    assert outs["raw"].outputs[0].token_ids == outs["pre"].outputs[0].token_ids

    wrong = [dataclasses.replace(m, content_hash="0" * 64) for m in precomputed]
    with pytest.raises(ValueError, match="image features are of image"):
        engine.add_request("x", ids, greedy(), mm_inputs=wrong)
    other = ImageFeatures(precomputed[0].content_hash, precomputed[0].features.embeds, "other")
    with pytest.raises(ValueError, match="fingerprint"):
        engine.add_request(
            "x",
            ids,
            greedy(),
            mm_inputs=[dataclasses.replace(precomputed[0], features=other), precomputed[1]],
        )


@pytest.fixture(scope="module")
def prefill_engine(tiny_llava_path) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llava_path), **ENGINE_ARGS))


@pytest.fixture(scope="module")
def decode_engine(tiny_llava_path) -> LLMEngine:
    # Another block size than the prefill side: the payload is per token.
    args = dict(ENGINE_ARGS, block_size=8, num_kv_blocks=256)
    return LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llava_path), **args))


def test_kv_handoff_with_images_equals_colocated(llm, hf, prefill_engine, decode_engine, encoder):
    prompts = PROMPTS[:3]
    requests = [(t, *_mm_request(prefill_engine, t, imgs)) for t, imgs in prompts]
    pre = _run(
        prefill_engine,
        [
            (f"p{i}", ids, {"export_kv": True, "mm_inputs": mm})
            for i, (_, ids, mm) in enumerate(requests)
        ],
    )
    decode_requests, recompute_requests = [], []
    for i, (text, images) in enumerate(prompts):
        ids, features = _mm_request(decode_engine, text, images, encoder)
        handoff = pre[f"p{i}"].kv_handoff
        assert handoff.metadata.image_hashes
        decode_requests.append((f"d{i}", ids, {"handoff": handoff, "mm_inputs": features}))
        # A lost transfer: the decode side recomputes the prompt, images included.
        lost = dataclasses.replace(handoff, kv=None)
        recompute_requests.append((f"r{i}", ids, {"handoff": lost, "mm_inputs": features}))
    decoded = _run(decode_engine, decode_requests)
    recomputed = _run(decode_engine, recompute_requests)
    for i, (text, images) in enumerate(prompts):
        expected = hf_greedy(hf, hf_inputs(hf, text, images))
        assert generate(llm, text, images).outputs[0].token_ids == expected
        assert decoded[f"d{i}"].outputs[0].token_ids == expected
        assert recomputed[f"r{i}"].outputs[0].token_ids == expected

    # The payload of image A offered with image B: refused before anything is queued.
    text, _ = PROMPTS[0]
    ids, with_b = _mm_request(decode_engine, text, [B])
    with pytest.raises(KVTransferError, match="other images"):
        decode_engine.add_request(
            "bad", ids, greedy(), handoff=pre["p0"].kv_handoff, mm_inputs=with_b
        )
    assert_idle(decode_engine)


def test_bad_image_requests_are_refused(llm, tiny_llama_path):
    engine = llm.engine
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        llm.generate({"prompt": "<image> and <image>", "multi_modal_data": {"image": A}})
    with pytest.raises(ValueError, match=r"16 image placeholder tokens .* but 0 images"):
        engine.add_request("x", _mm_request(engine, "<image> hi", [A])[0], greedy())
    ids, mm = _mm_request(engine, "Hi <image> there", [A])
    with pytest.raises(ValueError, match="not a run of image tokens"):
        engine.add_request("x", ids, greedy(), mm_inputs=[dataclasses.replace(mm[0], offset=0)])
    with pytest.raises(ValueError, match="cannot be decoded"):
        engine.add_request("x", ids, greedy(), mm_inputs=[dataclasses.replace(mm[0], image=b"x")])
    with pytest.raises(ValueError, match="features or the image"):
        engine.add_request("x", ids, greedy(), mm_inputs=[dataclasses.replace(mm[0], image=None)])
    with pytest.raises(ValueError, match="data: URLs"):
        llm.chat(
            [{"role": "user", "content": [{"type": "image_url", "image_url": "http://x/a.png"}]}]
        )
    assert_idle(engine)

    text_llm = LLM(model=str(tiny_llama_path), max_model_len=128, num_kv_blocks=64)
    with pytest.raises(ValueError, match="no vision tower"):
        text_llm.generate({"prompt": "<image> hi", "multi_modal_data": {"image": A}})
    with pytest.raises(ValueError, match="no vision tower: it cannot take images"):
        text_llm.engine.add_request("x", [1, 2, 3], greedy(), mm_inputs=mm)
    assert_idle(text_llm.engine)


def test_async_engine_passes_images_through(tiny_llava_path, llm):
    text, images = PROMPTS[1]
    expected = generate(llm, text, images).outputs[0].token_ids

    async def main() -> list[int]:
        engine = AsyncEngine.from_engine_args(EngineArgs(model=str(tiny_llava_path), **ENGINE_ARGS))
        try:
            ids, mm = _mm_request(engine.engine, text, images)
            final = None
            async for out in engine.generate(
                {"prompt_token_ids": ids}, greedy(), kind=RequestOutputKind.FINAL_ONLY, mm_inputs=mm
            ):
                final = out
            assert_idle(engine.engine)
            return final.outputs[0].token_ids
        finally:
            engine.shutdown()

    assert asyncio.run(main()) == expected
