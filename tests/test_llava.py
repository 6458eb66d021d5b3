"""CLIP and LLaVA against transformers' own implementations, on the same random weights.

The tiny LLaVA (configs/build_tiny_llava.py): CLIP tower 56 px / patch 14 (16 image tokens),
projector, 2-layer Llama with GQA, the SmolLM2 tokenizer plus ``<image>``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from neuron_runtime.config import ModelConfig
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.layers.attention import AttentionMetadata, PrefillSlice
from neuron_runtime.loader import iter_weights, load_hf_config, load_model
from neuron_runtime.models.clip import CLIPVisionModel
from neuron_runtime.models.llava import LlavaForConditionalGeneration, complete_config
from neuron_runtime.models.registry import model_class
from neuron_runtime.multimodal import ImageProcessorConfig, VisionEncoder

# fp32 on both sides; the towers run the same ops in the same order, the LM another order.
FEATURE_ATOL = 1e-5
LOGIT_ATOL = 1e-4


def random_image(seed: int, width: int, height: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if mode == "L" else pixels, mode)


@pytest.fixture(scope="module")
def hf_llava(tiny_llava_path):
    from transformers import LlavaForConditionalGeneration as HFLlava

    return HFLlava.from_pretrained(tiny_llava_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_processor(tiny_llava_path):
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor.from_pretrained(tiny_llava_path)


@pytest.mark.parametrize("hidden_act", ["quick_gelu", "gelu"])
def test_clip_tower_matches_transformers(tmp_path, hidden_act):
    from transformers import CLIPVisionConfig
    from transformers import CLIPVisionModel as HFCLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=28,
        patch_size=7,
        hidden_act=hidden_act,
    )
    torch.manual_seed(0)
    ref = HFCLIPVisionModel(config).eval()
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.2)
    ref.save_pretrained(tmp_path)
    cfg = load_hf_config(tmp_path)
    ours = CLIPVisionModel(cfg)
    ours.load_weights(iter_weights(tmp_path))
    pixels = torch.randn(2, 3, 28, 28)
    with torch.inference_mode():
        expected = ref(pixels, output_hidden_states=True)
        states = ours(pixels)
        pooled = ours.pool(states[-1])
    assert len(states) == len(expected.hidden_states) == 4
    for got, want in zip(states, expected.hidden_states, strict=True):
        torch.testing.assert_close(got, want, atol=FEATURE_ATOL, rtol=0)
    torch.testing.assert_close(pooled, expected.pooler_output, atol=FEATURE_ATOL, rtol=0)
    # A tower cut after layer 2 reads only the weights it needs.
    short = CLIPVisionModel(cfg, num_layers=2)
    short.load_weights(iter_weights(tmp_path, keep=short.wants_weight))
    with torch.inference_mode():
        torch.testing.assert_close(
            short(pixels)[-1], expected.hidden_states[2], atol=FEATURE_ATOL, rtol=0
        )


def test_preprocessing_matches_clip_image_processor(tiny_llava_path, hf_processor, tmp_path):
    ours = ImageProcessorConfig.from_folder(tiny_llava_path)
    images = [
        random_image(0, 90, 70),
        random_image(1, 70, 90),
        random_image(2, 20, 31),  # upscaled
        random_image(3, 300, 56),
        random_image(4, 64, 48, "RGBA"),
        random_image(5, 57, 80, "L"),
    ]
    expected = hf_processor(images=images, return_tensors="np")["pixel_values"]
    got = ours.preprocess(images)
    assert got.dtype == np.float32 and got.shape == (6, 3, 56, 56)
    np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)

    # A fixed resize, a crop larger than the image (zero padding), other mean/std.
    from transformers import CLIPImageProcessor

    other = CLIPImageProcessor(
        size={"height": 40, "width": 30},
        crop_size={"height": 45, "width": 33},
        image_mean=[0.5, 0.4, 0.3],
        image_std=[0.2, 0.3, 0.4],
        resample=2,
    )
    other.save_pretrained(tmp_path)
    got = ImageProcessorConfig.from_folder(tmp_path).preprocess(images)
    np.testing.assert_allclose(
        got, other(images=images, return_tensors="np")["pixel_values"], atol=1e-6, rtol=0
    )


def test_image_features_match_transformers(tiny_llava_path, hf_llava, hf_processor):
    images = [random_image(0, 90, 70), random_image(1, 56, 56)]
    pixels = hf_processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        expected = hf_llava.get_image_features(pixel_values=pixels).pooler_output
    encoder = VisionEncoder.from_pretrained(tiny_llava_path)
    assert encoder.model.language_model is None  # the LM's weights were never read
    assert (encoder.tokens_per_image, encoder.hidden_size) == (16, 64)
    got = encoder.encode_images(images)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == np.float32 and g.shape == (16, 64)
        np.testing.assert_allclose(g, e.numpy(), atol=FEATURE_ATOL, rtol=0)


def prompt_logits(
    model, ids: list[int], features: torch.Tensor, offsets: list[int]
) -> torch.Tensor:
    """Our model over one prompt in one prefill slice, images placed at ``offsets``."""
    cfg = model.config["text_config"]
    n, bs = len(ids), 4
    shape = (cfg["num_key_value_heads"], -(-n // bs), bs, cfg["head_dim"])
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg["num_hidden_layers"])]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        num_decode=0,
        prefills=[PrefillSlice(0, n, 0, torch.arange(shape[1]))],
    )
    with torch.inference_mode():
        embeds = model.embed_input_ids(torch.tensor(ids))
        for offset, feats in zip(offsets, features, strict=True):
            embeds[offset : offset + len(feats)] = feats
        hidden = model(torch.tensor(ids), torch.arange(n), caches, meta, inputs_embeds=embeds)
        return model.compute_logits(hidden)


def image_prompt(tokenizer, text: str, image_token_id: int) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` with each ``<image>`` expanded to 16 placeholders; offsets."""
    ids: list[int] = []
    offsets = []
    for i, piece in enumerate(text.split("<image>")):
        if i:
            offsets.append(len(ids))
            ids.extend([image_token_id] * 16)
        ids.extend(tokenizer.encode(piece, add_special_tokens=False))
    return ids, offsets


def test_prompt_logits_match_transformers(tiny_llava_path, hf_llava, hf_processor):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llava_path)
    cfg = load_hf_config(tiny_llava_path)
    ours = load_model(model_class(cfg["architectures"][0]), cfg, tiny_llava_path)
    images = [random_image(0, 90, 70), random_image(1, 60, 64)]
    pixels = hf_processor(images=images, return_tensors="pt")["pixel_values"]
    for text, imgs in [
        ("Look at this: <image> What is it?", slice(0, 1)),
        ("<image> and <image>: which one is larger?", slice(0, 2)),
    ]:
        ids, offsets = image_prompt(tokenizer, text, ours.image_token_id)
        with torch.inference_mode():
            expected = hf_llava(input_ids=torch.tensor([ids]), pixel_values=pixels[imgs]).logits[0]
            features = ours.encode_images(pixels[imgs])
        got = prompt_logits(ours, ids, features, offsets)
        torch.testing.assert_close(got, expected, atol=LOGIT_ATOL, rtol=0)


def _resave(path, out, rename) -> None:
    """The tiny LLaVA folder with its tensors renamed by ``rename``."""
    out.mkdir()
    for file in path.iterdir():
        if file.name != "model.safetensors":
            (out / file.name).write_bytes(file.read_bytes())
    tensors = load_file(path / "model.safetensors")
    save_file({rename(k): v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")


def _llava15_name(name: str) -> str:
    return name.replace("vision_tower.", "vision_tower.vision_model.", 1)


def _transformers5_name(name: str) -> str:
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    return "model." + name


@pytest.mark.parametrize("rename", [_llava15_name, _transformers5_name])
def test_both_checkpoint_layouts_load(tiny_llava_path, tmp_path, rename):
    ids = list(range(100, 110)) + [49152] * 16 + [7, 8]
    pixels = torch.randn(1, 3, 56, 56)
    cfg = load_hf_config(tiny_llava_path)
    reference = load_model(LlavaForConditionalGeneration, cfg, tiny_llava_path)
    _resave(tiny_llava_path, tmp_path / "renamed", rename)
    original = set(load_file(tiny_llava_path / "model.safetensors"))
    assert (
        set(load_file(tmp_path / "renamed" / "model.safetensors"))
        == {rename(name) for name in original}
        != original
    )
    renamed = load_model(LlavaForConditionalGeneration, cfg, tmp_path / "renamed")
    with torch.inference_mode():
        want = reference.encode_images(pixels)
        got = renamed.encode_images(pixels)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(
        prompt_logits(renamed, ids, got, [10]),
        prompt_logits(reference, ids, want, [10]),
        atol=0,
        rtol=0,
    )
    encoder = VisionEncoder.from_pretrained(tmp_path / "renamed")
    np.testing.assert_array_equal(encoder.encode(pixels.numpy())[0], want[0].numpy())


def test_model_config_reads_the_text_config(tiny_llava_path):
    config = EngineArgs(model=str(tiny_llava_path)).create_engine_config().model
    assert config.is_multimodal
    assert (config.num_layers, config.num_kv_heads, config.head_dim) == (2, 2, 16)
    assert config.vocab_size == 49153
    assert config.max_model_len == 1024


def test_a_sparse_llava15_config_gets_transformers_defaults():
    # The config.json of llava-hf/llava-1.5-7b-hf, as published.
    sparse = {
        "architectures": ["LlavaForConditionalGeneration"],
        "ignore_index": -100,
        "image_token_index": 32000,
        "model_type": "llava",
        "pad_token_id": 32001,
        "projector_hidden_act": "gelu",
        "text_config": {
            "_name_or_path": "lmsys/vicuna-7b-v1.5",
            "architectures": ["LlamaForCausalLM"],
            "max_position_embeddings": 4096,
            "model_type": "llama",
            "rms_norm_eps": 1e-05,
            "torch_dtype": "float16",
            "vocab_size": 32064,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.36.0.dev0",
        "vision_config": {
            "hidden_size": 1024,
            "image_size": 336,
            "intermediate_size": 4096,
            "model_type": "clip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "patch_size": 14,
            "projection_dim": 768,
            "vocab_size": 32000,
        },
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": 32064,
    }
    from transformers import LlavaConfig

    hf = LlavaConfig(**json.loads(json.dumps(sparse)))
    cfg = complete_config(sparse)
    model = ModelConfig(path="", hf_config=cfg, max_model_len=4096)
    text = hf.text_config
    assert model.num_layers == text.num_hidden_layers == 32
    assert model.num_kv_heads == text.num_key_value_heads == 32
    assert model.head_dim == text.hidden_size // text.num_attention_heads == 128
    assert model.vocab_size == 32064
    assert cfg["text_config"]["intermediate_size"] == text.intermediate_size
    assert cfg["vision_config"]["hidden_act"] == hf.vision_config.hidden_act == "quick_gelu"
    assert cfg["vision_config"]["layer_norm_eps"] == hf.vision_config.layer_norm_eps
