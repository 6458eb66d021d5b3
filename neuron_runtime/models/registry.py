"""HF ``architectures`` name -> our model class."""

from __future__ import annotations

from torch import nn

from neuron_runtime.models.bert import BertModel
from neuron_runtime.models.gemma3 import Gemma3ForCausalLM
from neuron_runtime.models.llama import LlamaForCausalLM
from neuron_runtime.models.mistral import MistralForCausalLM
from neuron_runtime.models.qwen2 import Qwen2ForCausalLM
from neuron_runtime.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {supported}"
        ) from None
