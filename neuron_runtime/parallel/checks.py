"""Whether a model can be split the way a ParallelConfig asks, checked before anything loads."""

from __future__ import annotations

from neuron_runtime.config import ModelConfig, ParallelConfig
from neuron_runtime.parallel.layers import head_shard

# Decoder families built from the sharded layers (models/llama.py and its subclasses).
SHARDABLE = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
    }
)
MOE = frozenset({"MixtralForCausalLM", "Qwen3MoeForCausalLM"})


def check_shardable(model: ModelConfig, parallel: ParallelConfig) -> None:
    """ValueError naming the setting when ``model`` cannot run under ``parallel``."""
    tp = parallel.tensor_parallel_size
    arch = model.architecture
    if parallel.data_parallel_size > 1:
        raise ValueError(
            f"data_parallel_size {parallel.data_parallel_size}: an engine is one data-parallel "
            "rank; the Serve app (app.builder) runs that many engine replicas"
        )
    if parallel.enable_expert_parallel and arch not in MOE:
        raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model, not {arch}")
    if tp == 1:
        return
    if arch not in SHARDABLE:
        raise ValueError(
            f"tensor_parallel_size {tp}: {arch} cannot be sharded; supported: "
            f"{', '.join(sorted(SHARDABLE))}"
        )
    cfg = model.text_config
    for rank in range(tp):
        head_shard(int(cfg["num_attention_heads"]), model.num_kv_heads, tp, rank)
    if model.vocab_size < tp:
        raise ValueError(f"tensor_parallel_size {tp} exceeds the vocabulary ({model.vocab_size})")
    if arch in MOE and parallel.enable_expert_parallel:
        experts = int(cfg.get("num_local_experts") or cfg["num_experts"])
        if experts < tp:
            raise ValueError(
                f"enable_expert_parallel: {experts} experts cannot spread over {tp} ranks"
            )
