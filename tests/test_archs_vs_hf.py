"""Qwen2, Qwen3, Mistral and Gemma 3 against transformers' own implementations, same weights.

Tiny random checkpoints (tests/conftest.py, TINY_FAMILIES) with sliding windows of 8 tokens
and KV blocks of 4, so prompts span many blocks and outrun the window; the sliding-window mask
itself is checked against transformers' mask function.
"""

from __future__ import annotations

import pytest
import torch
from test_llama_vs_hf import hf_greedy, hf_model

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.layers.attention import AttentionMetadata, PrefillSlice, _prefill_mask
from neuron_runtime.loader import load_hf_config, load_model
from neuron_runtime.models.registry import model_class

# fp32 on both sides, different op order (and paged, chunked attention on ours): every
# position's logits agree to this absolute tolerance.
LOGIT_ATOL = 1e-4
BLOCK_SIZE = 4
PREFILL_CHUNK = 5  # not a multiple of BLOCK_SIZE: chunks start mid-block
NUM_GREEDY_TOKENS = 32

# Longer than the 8-token windows of the tiny configs.
PROMPTS = [
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, and the sea",
    "Rain had fallen on the harbour town for three days without a pause; the fishermen",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
    "1, 2, 3,",
]


def _no_decode() -> dict:
    return dict(
        num_decode=0,
        decode_block_ids=torch.empty(0, dtype=torch.long),
        decode_masked=torch.empty(0, 1, 0, dtype=torch.bool),
    )


def stepped_logits(model, cfg: dict, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, fed the way the engine feeds it: [n, vocab].

    The first two thirds go in as prefill chunks of PREFILL_CHUNK tokens (the first from an
    empty cache, the others attending to cached blocks too), the rest one token at a time
    through the decode path.
    """
    n = len(token_ids)
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    shape = (kv_heads, -(-n // BLOCK_SIZE), BLOCK_SIZE, head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg["num_hidden_layers"])]
    split = 2 * n // 3
    rows = []
    pos = 0
    while pos < n:
        if pos < split:
            end = min(pos + PREFILL_CHUNK, split)
            blocks = torch.arange(-(-end // BLOCK_SIZE))
            meta = AttentionMetadata(
                slot_mapping=torch.arange(pos, end),
                prefills=[PrefillSlice(0, end - pos, pos, blocks)],
                **_no_decode(),
            )
        else:
            end = pos + 1
            used = -(-end // BLOCK_SIZE)
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([pos]),
                num_decode=1,
                decode_block_ids=torch.arange(used),
                decode_masked=(torch.arange(used * BLOCK_SIZE) >= end).view(1, 1, -1),
                prefills=[],
                decode_context_lens=torch.tensor([end]),
            )
        with torch.inference_mode():
            hidden = model(torch.tensor(token_ids[pos:end]), torch.arange(pos, end), caches, meta)
            rows.append(model.compute_logits(hidden))
        pos = end
    return torch.cat(rows)


def test_every_family_is_registered():
    for arch in ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM"]:
        assert model_class(arch).__name__ == arch


def test_tiny_family_logits_and_greedy(tiny_family_path):
    path = tiny_family_path
    cfg = load_hf_config(path)
    ref = hf_model(path)
    ours = load_model(model_class(cfg["architectures"][0]), cfg, path)
    llm = LLM(
        model=str(path),
        max_model_len=256,
        block_size=BLOCK_SIZE,
        num_kv_blocks=256,
        max_num_batched_tokens=16,  # prompts are prefilled in chunks, batched with decodes
    )
    prompts = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert max(len(p) for p in prompts) > 2 * 8, "prompts must outrun the sliding window"
    for ids in prompts[:3]:
        with torch.inference_mode():
            expected = ref(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(
            stepped_logits(ours, cfg, ids), expected, atol=LOGIT_ATOL, rtol=0
        )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    for ids, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, ids, NUM_GREEDY_TOKENS)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window_mask_matches_transformers(window):
    from transformers.masking_utils import sliding_window_causal_mask_function

    visible = sliding_window_causal_mask_function(window)
    ctx = 13
    pos = [torch.tensor(i) for i in range(ctx)]
    expected = torch.tensor(
        [[bool(visible(0, 0, qi, kj)) for kj in pos] for qi in pos]
    )  # [query position, key position]
    # Prefill slices starting at every offset, one query row per position of the slice.
    for start in range(ctx):
        slice_ = PrefillSlice(0, ctx - start, start, torch.arange(4))
        mask = _prefill_mask(slice_, window, True, torch.device("cpu"))
        assert torch.equal(mask, expected[start:]), start
    # Decodes: one query per sequence at position context_len - 1, keys padded to 16.
    context_lens = torch.arange(1, ctx + 1)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_decode=ctx,
        decode_block_ids=torch.empty(0, dtype=torch.long),
        decode_masked=(torch.arange(16) >= context_lens.unsqueeze(1)).unsqueeze(1),
        prefills=[],
        decode_context_lens=context_lens,
    )
    decode_visible = ~meta.decode_mask(window)[:, 0, :ctx]
    assert torch.equal(decode_visible, expected)
