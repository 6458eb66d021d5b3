"""Frozen engine configuration, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from neuron_runtime.spec_decode.config import SpeculativeConfig


def text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """``hf_config["text_config"]`` for a vision-language model, else ``hf_config`` itself."""
    return hf_config.get("text_config") or hf_config


DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """What to load: a resolved HF folder and its config.json contents."""

    path: str
    hf_config: dict[str, Any]
    max_model_len: int
    name: str = ""
    # What the linear layers and the logits head compute in (DTYPES): "bfloat16" rounds their
    # weights and inputs to bf16 and sums in fp32 (the CPU kernels, where the CPU has
    # AVX512_BF16); everything else stays fp32.
    dtype: str = "float32"
    # What the KV cache stores keys and values in (DTYPES): "bfloat16" rounds them once, as
    # they are written (attention reads them back widened to fp32 and sums in fp32), and
    # halves the cache's bytes. Part of the KV a prefill hands to a decode engine.
    kv_cache_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(DTYPES)} (or 'auto' in EngineArgs), "
                f"got {self.kv_cache_dtype!r}"
            )

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or []
        return archs[0] if archs else ""

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's settings: ``text_config`` of a vision-language model."""
        return text_config(self.hf_config)

    @property
    def is_multimodal(self) -> bool:
        return "vision_config" in self.hf_config

    @property
    def num_layers(self) -> int:
        return int(self.text_config["num_hidden_layers"])

    @property
    def num_kv_heads(self) -> int:
        cfg = self.text_config
        return int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])

    @property
    def head_dim(self) -> int:
        cfg = self.text_config
        head_dim = cfg.get("head_dim")
        return int(head_dim or cfg["hidden_size"] // cfg["num_attention_heads"])

    @property
    def vocab_size(self) -> int:
        return int(self.text_config["vocab_size"])


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and budget (in blocks or bytes; blocks win)."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 512 * 1024 * 1024
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Token-budget continuous batching limits."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


GRAPH_MODES = ("eager", "inductor", "openxla", "lazy", "neuronx")


@dataclass(frozen=True)
class GraphConfig:
    """How steps run: eager with dynamic shapes, or as graphs compiled per shape bucket.

    ``graph_mode``: ``eager`` (no compiler), ``inductor`` (torch.compile; CPU and CUDA),
    ``openxla`` and ``lazy`` (torch-xla), ``neuronx`` (torch-neuronx on Trainium). Every mode
    but ``eager`` runs the static runner (backends/static/): steps padded to buckets, one
    compiled graph per (phase, bucket), all compiled at start. Empty bucket lists are generated
    from the scheduler limits (powers of two, the maximum included).
    """

    graph_mode: str = "eager"
    seq_buckets: tuple[int, ...] = ()  # decode batch sizes
    token_buckets: tuple[int, ...] = ()  # prefill slice lengths
    context_buckets: tuple[int, ...] = ()  # context lengths, in KV blocks
    # top-k/top-p over this many best tokens instead of a full-vocabulary sort (Neuron: 256);
    # None sorts the whole vocabulary, as the eager sampler does.
    max_top_k: int | None = None
    on_recompile: str = "warn"  # a compile after warm-up: "warn" or "error"
    # "step": one graph per bucket holds the whole step (XLA and Neuron trace it that way);
    # "layer": the decoder layer is compiled once per bucket and shared by every layer, the
    # rest runs eager (inductor compiles a 30-layer step ~30x faster). None: "layer" for
    # inductor, "step" otherwise.
    compile_scope: str | None = None

    def __post_init__(self) -> None:
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(
                f"graph_mode must be one of {', '.join(GRAPH_MODES)}, got {self.graph_mode!r}"
            )
        if self.on_recompile not in ("warn", "error"):
            raise ValueError(f"on_recompile must be 'warn' or 'error', got {self.on_recompile!r}")
        for name in ("seq_buckets", "token_buckets", "context_buckets"):
            values = getattr(self, name)
            if any(v < 1 for v in values) or list(values) != sorted(set(values)):
                raise ValueError(f"{name} must be increasing positive integers, got {values}")
        if self.compile_scope not in (None, "step", "layer"):
            raise ValueError(f"compile_scope must be 'step' or 'layer', got {self.compile_scope!r}")
        if self.compile_scope == "layer" and self.graph_mode in ("lazy", "neuronx"):
            raise ValueError(
                f"graph_mode {self.graph_mode!r} traces whole steps: compile_scope step"
            )
        if self.max_top_k is not None and self.max_top_k < 1:
            raise ValueError(f"max_top_k must be >= 1, got {self.max_top_k}")

    @property
    def static(self) -> bool:
        return self.graph_mode != "eager"

    @property
    def scope(self) -> str:
        if self.compile_scope is not None:
            return self.compile_scope
        return "layer" if self.graph_mode == "inductor" else "step"


COLLECTIVE_BACKENDS = ("gloo", "nccl", "xla")
# How ranks 1..tp-1 start: "mp" processes of this host; "ray" actors in the Serve replica's
# placement group (deployments/parallel_ranks.py registers it).
EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine replica spans processes (neuron_runtime/parallel/).

    ``tensor_parallel_size`` ranks hold a shard of every layer (one process each);
    ``enable_expert_parallel`` spreads a mixture-of-experts model's experts over those ranks
    instead of slicing every expert; ``data_parallel_size`` replicas each run the whole model
    on their own requests. ``collective_backend`` None: the device's (gloo on CPU, nccl on
    CUDA, xla on XLA/Neuron devices).
    """

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    collective_backend: str | None = None
    distributed_executor_backend: str = "mp"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.collective_backend not in (None, *COLLECTIVE_BACKENDS):
            raise ValueError(
                f"collective_backend must be one of {', '.join(COLLECTIVE_BACKENDS)}, "
                f"got {self.collective_backend!r}"
            )
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs; built by ``EngineArgs.create_engine_config``."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    num_threads: int | None = None
    graph: GraphConfig = field(default_factory=GraphConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        sched = self.scheduler
        if (
            not sched.enable_chunked_prefill
            and sched.max_num_batched_tokens < self.model.max_model_len
        ):
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({sched.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.model.max_model_len}) so every prompt fits in one step"
            )
        if self.parallel.tensor_parallel_size > 1 and (self.graph.static or self.speculative):
            raise ValueError(
                "tensor_parallel_size > 1 runs graph_mode 'eager' only, without speculative_config"
            )
        spec = self.speculative
        if spec is not None and self.graph.static and spec.method != "ngram":
            # Draft models and EAGLE heads draft with eager forwards; the static backend has
            # graphs only.
            raise ValueError(
                f"speculative_config.method {spec.method!r} runs with graph_mode 'eager' only; "
                "static graphs speculate with 'ngram'"
            )
