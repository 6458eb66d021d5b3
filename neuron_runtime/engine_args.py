"""User-facing engine options (vLLM's names) -> validated EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass

from neuron_runtime.backends.base import default_graph_mode
from neuron_runtime.config import (
    CacheConfig,
    EngineConfig,
    GraphConfig,
    ModelConfig,
    SchedulerConfig,
    text_config,
)
from neuron_runtime.loader import load_hf_config
from neuron_runtime.model_store import resolve_model
from neuron_runtime.models.registry import complete_config


@dataclass
class EngineArgs:
    """Keyword arguments of ``LLM(...)`` and of the serving deployments."""

    model: str = "smollm2-135m-instruct"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
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

    def create_engine_config(self) -> EngineConfig:
        path = resolve_model(self.model)
        hf_config = complete_config(load_hf_config(path))
        limit = int(text_config(hf_config).get("max_position_embeddings") or 2048)
        max_model_len = self.max_model_len or limit
        if max_model_len > limit:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's "
                f"max_position_embeddings ({limit})"
            )
        cache = CacheConfig(
            block_size=self.block_size,
            num_blocks=self.num_kv_blocks,
            kv_cache_bytes=self.kv_cache_memory_bytes,
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
        model = ModelConfig(
            path=str(path), hf_config=hf_config, max_model_len=max_model_len, name=self.model
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
        )
