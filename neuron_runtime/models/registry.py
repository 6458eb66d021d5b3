"""HF ``architectures`` name -> our model class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from neuron_runtime.models.bert import BertModel
from neuron_runtime.models.gemma3 import Gemma3ForCausalLM
from neuron_runtime.models.llama import LlamaForCausalLM
from neuron_runtime.models.llava import LlavaForConditionalGeneration
from neuron_runtime.models.llava import complete_config as complete_llava_config
from neuron_runtime.models.mistral import MistralForCausalLM
from neuron_runtime.models.mixtral import MixtralForCausalLM
from neuron_runtime.models.qwen2 import Qwen2ForCausalLM
from neuron_runtime.models.qwen3 import Qwen3ForCausalLM
from neuron_runtime.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}

# Architectures whose config.json may leave out keys the engine reads (sizes of a nested
# text_config): these fill in the defaults transformers would use.
CONFIG_COMPLETERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "LlavaForConditionalGeneration": complete_llava_config,
}


def complete_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """config.json contents with the defaults of its architecture filled in."""
    archs = hf_config.get("architectures") or [""]
    complete = CONFIG_COMPLETERS.get(archs[0])
    return hf_config if complete is None else complete(hf_config)


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {supported}"
        ) from None
