"""Builds the tiny random-weight LLaVA (``tiny-llava``): CLIP vision tower + projector + Llama.

No vision-language weights ship offline (see MODELS.md), so tests and the EPD serve config use
this model: transformers' own ``LlavaForConditionalGeneration`` with a fixed seed, saved as a
normal HF folder (config.json, model.safetensors, tokenizer, preprocessor_config.json, chat
template). The tokenizer is SmolLM2's plus one added special token, ``<image>``.

Usage: ``python configs/build_tiny_llava.py OUT_DIR [TOKENIZER_DIR]`` (the tokenizer defaults
to the converted SmolLM2 folder of the model store).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 56  # (56 / 14)^2 = 16 patches: 16 image tokens per image (CLS dropped)
SEED = 0

# SmolLM2's template, with list contents: text parts as text, image parts as <image>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}{{ '" + IMAGE_TOKEN + "' }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build(out: Path, tokenizer_src: Path) -> Path:
    """Writes the tiny LLaVA folder to ``out``; returns ``out``."""
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_src)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    tokenizer.chat_template = CHAT_TEMPLATE
    vision = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=14,
        projection_dim=32,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    num_patches = (IMAGE_SIZE // 14) ** 2
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        image_seq_length=num_patches,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
    )
    torch.manual_seed(SEED)
    model = LlavaForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        # HF starts norms at ones/zeros and biases at zero; noise makes convention bugs show,
        # and wider image features make images change the greedy tokens.
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
            elif "multi_modal_projector" in name:
                param.mul_(4.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    # The LlavaProcessor (AutoProcessor) writes the image processor and the tokenizer.
    LlavaProcessor(
        image_processor=processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLS, which "default" drops again
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(out)
    processor.save_pretrained(out)  # preprocessor_config.json too, as llava-hf folders have
    generation = tokenizer_src / "generation_config.json"
    if generation.is_file():
        shutil.copy(generation, out / "generation_config.json")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("tokenizer", type=Path, nargs="?")
    args = parser.parse_args(argv)
    if args.tokenizer is None:
        from neuron_runtime.model_store import resolve_model

        args.tokenizer = resolve_model("smollm2-135m-instruct")
    print(build(args.out, args.tokenizer))


if __name__ == "__main__":
    main()
