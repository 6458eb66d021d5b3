"""HF ``architectures`` name -> our model class."""

from __future__ import annotations

from torch import nn

from neuron_runtime.models.bert import BertModel
from neuron_runtime.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "LlamaForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {supported}"
        ) from None
