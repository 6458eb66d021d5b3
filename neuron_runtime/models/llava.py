"""LLaVA (``LlavaForConditionalGeneration``): CLIP vision tower + MLP projector + a decoder LM.

    image -> CLIP hidden states of ``vision_feature_layer`` (one layer, or several
             concatenated on the hidden axis) -> drop CLS ("default") or keep it ("full")
          -> multi_modal_projector (linear_1, act, linear_2) -> [tokens_per_image, lm_hidden]

The prompt holds ``tokens_per_image`` placeholder tokens (``image_token_index``) per image; the
model runner replaces their embedding rows with the image's features and the language model
(any registered decoder, built from ``text_config``) runs on those embeddings.

Checkpoints come in two layouts, both accepted: transformers 5 (``model.vision_tower.*``,
``model.multi_modal_projector.*``, ``model.language_model.*``, ``lm_head.*``) and the original
llava-hf one (``vision_tower.vision_model.*``, ``multi_modal_projector.*``,
``language_model.model.*``, ``language_model.lm_head.*``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from neuron_runtime.layers.activation import activation
from neuron_runtime.layers.attention import StepMetadata
from neuron_runtime.loader import copy_weights
from neuron_runtime.models.clip import CLIP_VISION_DEFAULTS, CLIPVisionModel
from neuron_runtime.models.llama import KVCache

# LlavaConfig defaults, for keys a config.json may leave out.
LLAVA_DEFAULTS: dict[str, Any] = {
    "image_token_index": 32000,
    "projector_hidden_act": "gelu",
    "vision_feature_select_strategy": "default",
    "vision_feature_layer": -2,
    "multimodal_projector_bias": True,
}
# LlavaConfig's vision tower when vision_config leaves a key out (CLIP ViT-L/14 at 336 px).
LLAVA_VISION_DEFAULTS: dict[str, Any] = {
    **CLIP_VISION_DEFAULTS,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 336,
    "patch_size": 14,
}
# LlamaConfig defaults: llava-1.5's text_config names little more than the vocabulary.
LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# checkpoint prefix -> (our submodule, prefix of the name inside it); first match wins.
_PREFIXES = (
    ("model.language_model.", "language_model", "model."),
    ("language_model.model.", "language_model", "model."),
    ("language_model.lm_head.", "language_model", "lm_head."),
    ("lm_head.", "language_model", "lm_head."),
    ("model.vision_tower.", "vision_tower", ""),
    ("vision_tower.", "vision_tower", ""),
    ("model.multi_modal_projector.", "multi_modal_projector", ""),
    ("multi_modal_projector.", "multi_modal_projector", ""),
)


def complete_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A LLaVA config.json with every default it relies on filled in, text and vision too."""
    cfg = {**LLAVA_DEFAULTS, **cfg}
    vision = {**LLAVA_VISION_DEFAULTS, **(cfg.get("vision_config") or {})}
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"unsupported LLaVA vision tower {vision['model_type']!r} (CLIP only)")
    text = dict(cfg.get("text_config") or {})
    model_type = text.get("model_type", "llama")
    if model_type == "llama":
        text = {**LLAMA_DEFAULTS, **text}
    if not text.get("architectures"):
        if model_type not in TEXT_ARCHITECTURES:
            raise ValueError(f"unsupported LLaVA language model type {model_type!r}")
        text["architectures"] = [TEXT_ARCHITECTURES[model_type]]
    return {**cfg, "vision_config": vision, "text_config": text}


def feature_layers(cfg: dict[str, Any]) -> list[int]:
    """``vision_feature_layer`` as indices into the tower's hidden states (0 = embeddings)."""
    layer = cfg["vision_feature_layer"]
    num_states = cfg["vision_config"]["num_hidden_layers"] + 1
    layers = [layer] if isinstance(layer, int) else list(layer)
    return [i % num_states for i in layers]


def tokens_per_image(cfg: dict[str, Any]) -> int:
    vision = cfg["vision_config"]
    num_patches = (vision["image_size"] // vision["patch_size"]) ** 2
    return num_patches + (cfg["vision_feature_select_strategy"] == "full")


def split_name(name: str) -> tuple[str, str]:
    """A checkpoint name -> (our submodule, the name inside it), in either layout."""
    for prefix, part, inner in _PREFIXES:
        if name.startswith(prefix):
            return part, inner + name[len(prefix) :]
    raise ValueError(f"checkpoint tensor {name!r} has no place in LlavaForConditionalGeneration")


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        vision_hidden = cfg["vision_config"]["hidden_size"] * len(feature_layers(cfg))
        text_hidden = cfg["text_config"]["hidden_size"]
        bias = bool(cfg["multimodal_projector_bias"])
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = activation(cfg["projector_hidden_act"])
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    """Vision tower, projector and language model; ``language_model=False`` builds the image
    side only (a vision encoder that never reads the LM's weights)."""

    def __init__(self, cfg: dict[str, Any], language_model: bool = True) -> None:
        super().__init__()
        from neuron_runtime.models.registry import model_class  # the registry imports us

        cfg = complete_config(cfg)
        self.config = cfg
        self.feature_layers = feature_layers(cfg)
        self.drop_cls = cfg["vision_feature_select_strategy"] == "default"
        self.image_token_id = int(cfg["image_token_index"])
        self.tokens_per_image = tokens_per_image(cfg)
        self.vision_tower = CLIPVisionModel(cfg["vision_config"], max(self.feature_layers))
        self.multi_modal_projector = LlavaMultiModalProjector(cfg)
        text = cfg["text_config"]
        self.language_model: Any = (
            model_class(text["architectures"][0])(text) if language_model else None
        )

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] normalized pixels -> [B, tokens_per_image, lm_hidden] features."""
        states = self.vision_tower(pixel_values)
        selected = [states[i][:, 1:] if self.drop_cls else states[i] for i in self.feature_layers]
        return self.multi_modal_projector(torch.cat(selected, dim=-1))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: StepMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, lm_hidden], image rows filled in
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, kv_caches, meta, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        layers: nn.ModuleList = self.language_model.decoder_layers
        return layers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def wants_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor is read at all (not for skipped layers or a missing LM)."""
        part, inner = split_name(name)
        if part == "language_model":
            return self.language_model is not None
        return part != "vision_tower" or self.vision_tower.wants_weight(inner)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # The LM's tensors stream through; the image side's (small) are kept for the end.
        image_side: dict[str, list[tuple[str, torch.Tensor]]] = {
            "vision_tower": [],
            "multi_modal_projector": [],
        }

        def language() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not self.wants_weight(name):
                    continue
                part, inner = split_name(name)
                if part == "language_model":
                    yield inner, tensor
                else:
                    image_side[part].append((inner, tensor))

        if self.language_model is not None:
            self.language_model.load_weights(language())
        else:
            for _ in language():
                pass  # wants_weight drops every LM tensor: this only gathers the image side
        self.vision_tower.load_weights(image_side["vision_tower"])
        copy_weights(
            self.multi_modal_projector, image_side["multi_modal_projector"], "LLaVA projector"
        )
