"""neuron_runtime: an LLM inference engine in plain PyTorch (no Ray).

Paged KV cache, token-budget continuous batching, prefix caching, and an offline API shaped
like vLLM's::

    from neuron_runtime import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct")
    print(llm.generate("Hello", SamplingParams(max_tokens=8))[0].outputs[0].text)
"""

from neuron_runtime.async_engine import AsyncEngine, EngineDeadError
from neuron_runtime.embedding import EmbeddingEngine
from neuron_runtime.engine import EngineStats, LLMEngine
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.llm import LLM
from neuron_runtime.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from neuron_runtime.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EmbeddingEngine",
    "EngineArgs",
    "EngineDeadError",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
