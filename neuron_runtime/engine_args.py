"""User-facing engine options (vLLM's names) -> validated EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from neuron_runtime.backends.base import default_graph_mode
from neuron_runtime.config import (
    CacheConfig,
    EngineConfig,
    GraphConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    text_config,
)
from neuron_runtime.kv_budget import (
    DEFAULT_KV_CACHE_MEMORY_FRACTION,
    KVPlan,
    available_memory_bytes,
    kv_bytes_per_token,
    plan_kv_cache,
    weight_bytes,
)
from neuron_runtime.loader import load_hf_config
from neuron_runtime.model_store import gguf_source, resolve_model
from neuron_runtime.models.registry import complete_config
from neuron_runtime.parallel.checks import check_shardable
from neuron_runtime.spec_decode.config import SpeculativeConfig


@dataclass
class EngineArgs:
    """Keyword arguments of ``LLM(...)`` and of the serving deployments."""

    model: str = "smollm2-135m-instruct"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    # KV budget (kv_budget.py): unset, max(512 MiB, one max_model_len sequence) bounded by
    # kv_cache_memory_fraction of the host memory available after the weights.
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float = DEFAULT_KV_CACHE_MEMORY_FRACTION
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    device: str = "cpu"
    num_threads: int | None = None
    # Static-shape graphs (config.GraphConfig): "eager" runs without a compiler.
    graph_mode: str | None = None  # None: the device's default (neuron: neuronx)
    seq_buckets: list[int] | None = None
    token_buckets: list[int] | None = None
    context_buckets: list[int] | None = None
    max_top_k: int | None = None
    on_recompile: str = "warn"
    compile_scope: str | None = None
    # One replica over several processes (neuron_runtime/parallel/).
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    distributed_executor_backend: str = "mp"  # "ray": rank actors in the replica's bundles
    # Speculative decoding, vLLM's keys (spec_decode/config.py): {"method": "ngram",
    # "num_speculative_tokens": 4, "prompt_lookup_max": 3}, draft_model, eagle, eagle3.
    speculative_config: dict[str, Any] | None = None
    # Weights of a GGUF model: unset or "none" runs the dequantized fp32 checkpoint (the
    # reference for token identity); "gguf" keeps the file's Q4_1 / Q8_0 blocks on the CPU
    # kernels (backends/cpu_ops.py; one process on the CPU, other tensor types fp32).
    quantization: str | None = None
    # What the linear layers and the logits head compute in: "float32" (the reference), or
    # "bfloat16" (weights and their inputs rounded to bf16, fp32 sums; norms and attention
    # stay fp32): on the CPU kernels where the CPU has AVX512_BF16, eager only.
    dtype: str = "float32"
    # What the KV cache holds: "auto" (dtype's: a bfloat16 engine keeps a bfloat16 cache, as
    # vLLM's "auto" does), "float32" or "bfloat16" (any device and path: stored rounded,
    # read back widened to fp32; half the bytes per token, so twice the tokens per budget).
    kv_cache_dtype: str = "auto"

    def create_engine_config(self) -> EngineConfig:
        path = resolve_model(self.model)
        hf_config = self._with_quantization(path, complete_config(load_hf_config(path)))
        limit = int(text_config(hf_config).get("max_position_embeddings") or 2048)
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings ({limit})"
            )
        model = ModelConfig(
            path=str(path),
            hf_config=hf_config,
            max_model_len=self.max_model_len or limit,
            name=self.model,
            dtype=self.dtype,  # its one check of the name; _check_dtype_path below
            kv_cache_dtype=self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype,
        )
        self._check_dtype_path()
        parallel = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
        )
        check_shardable(model, parallel)
        plan = self._plan_kv_cache(model, limit)
        model = replace(model, max_model_len=plan.max_model_len)
        max_model_len = model.max_model_len
        cache = CacheConfig(
            block_size=self.block_size,
            num_blocks=self.num_kv_blocks,
            kv_cache_bytes=plan.kv_cache_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=batched,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )
        return EngineConfig(
            model=model,
            cache=cache,
            scheduler=scheduler,
            device=self.device,
            num_threads=self.num_threads,
            graph=GraphConfig(
                graph_mode=self.graph_mode or default_graph_mode(self.device),
                seq_buckets=tuple(self.seq_buckets or ()),
                token_buckets=tuple(self.token_buckets or ()),
                context_buckets=tuple(self.context_buckets or ()),
                max_top_k=self.max_top_k,
                on_recompile=self.on_recompile,
                compile_scope=self.compile_scope,
            ),
            speculative=self._speculative_config(),
            parallel=parallel,
        )

    def _check_dtype_path(self) -> None:
        """bf16 linear layers exist on the CPU kernels only (whether this CPU has AVX512_BF16
        is the CPU backend's check, where the engine runs)."""
        if self.dtype == "float32":
            return
        graph_mode = self.graph_mode or default_graph_mode(self.device)
        if self.device != "cpu" or graph_mode != "eager" or self.quantization == "gguf":
            raise ValueError(
                f"dtype {self.dtype!r} runs on the CPU kernels (device 'cpu', graph_mode "
                f"'eager', no GGUF quantization), got device {self.device!r}, graph_mode "
                f"{graph_mode!r}, quantization {self.quantization!r}"
            )

    def _with_quantization(self, path: Any, hf_config: dict[str, Any]) -> dict[str, Any]:
        """``hf_config`` with a GGUF ``quantization_config`` when the source file's quantized
        blocks are asked for (one CPU process: a tensor-parallel rank slices fp32 weights);
        ``load_model`` finds the file. No path goes in: the config fingerprints the model
        for KV transfers between hosts."""
        if self.quantization not in (None, "gguf", "none"):
            raise ValueError(
                f"quantization must be 'gguf', 'none' or unset, got {self.quantization!r}"
            )
        source = gguf_source(path)
        if self.quantization == "gguf" and source is None:
            raise ValueError(
                f"quantization 'gguf' needs a model converted from a .gguf file; {self.model!r} "
                "is not one (or its .gguf file changed since)"
            )
        if self.quantization != "gguf":
            return hf_config
        if self.device != "cpu" or self.tensor_parallel_size > 1:
            raise ValueError(
                "quantization 'gguf' runs on the CPU kernels of one process (device 'cpu', "
                f"tensor_parallel_size 1), got device {self.device!r}, "
                f"tensor_parallel_size {self.tensor_parallel_size}"
            )
        return {**hf_config, "quantization_config": {"quant_method": "gguf"}}

    def _speculative_config(self) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        config = SpeculativeConfig.from_dict(self.speculative_config)
        if config.model and not config.self_speculative(self.model):
            try:
                resolve_model(config.model)  # a missing draft or head fails here, not at load
            except ValueError as err:
                raise ValueError(f"speculative_config.model: {err}") from None
        return config

    def _plan_kv_cache(self, model: ModelConfig, limit: int) -> KVPlan:
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        auto = self.kv_cache_memory_bytes is None and self.num_kv_blocks is None
        return plan_kv_cache(
            bytes_per_token=kv_bytes_per_token(
                model.num_layers, model.num_kv_heads, model.head_dim, model.kv_cache_dtype
            ),
            block_size=self.block_size,
            model_limit=limit,
            max_model_len=self.max_model_len,
            kv_cache_bytes=self.kv_cache_memory_bytes,
            num_blocks=self.num_kv_blocks,
            memory_fraction=self.kv_cache_memory_fraction,
            available_bytes=available_memory_bytes() if auto else None,
            weight_bytes=weight_bytes(model.path) if auto else 0,
        )
