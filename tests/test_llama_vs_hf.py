"""Our Llama against transformers' own implementation on the same weights."""

from __future__ import annotations

import pytest
import torch

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.layers.attention import AttentionMetadata, PrefillSlice
from neuron_runtime.loader import load_hf_config, load_model
from neuron_runtime.models.llama import LlamaForCausalLM

# fp32 on both sides, different op order: logits agree to this absolute tolerance.
LOGIT_ATOL = 1e-3

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "Translate to German: Good morning, my friend.",
    "Les fleurs du jardin sont",
    "Q: What is the boiling point of water?\nA:",
    "import numpy as np\nx = np.",
]


def our_prompt_logits(path, token_ids: list[int]) -> torch.Tensor:
    """Runs one prompt through our model as a single prefill slice; logits for every row."""
    cfg = load_hf_config(path)
    model = load_model(LlamaForCausalLM, cfg, path)
    n = len(token_ids)
    block_size = 16
    num_blocks = -(-n // block_size)
    heads = cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    caches = [
        (
            torch.zeros(heads, num_blocks, block_size, head_dim),
            torch.zeros(heads, num_blocks, block_size, head_dim),
        )
        for _ in range(cfg["num_hidden_layers"])
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        num_decode=0,
        prefills=[PrefillSlice(0, n, 0, torch.arange(num_blocks))],
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(n), caches, meta)
        return model.compute_logits(hidden)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Plain greedy for a fixed length: no EOS stopping (min_new_tokens would mask EOS instead).
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_llama3_tied_path"])
def test_tiny_llama_logits_and_greedy(fixture, request):
    path = request.getfixturevalue(fixture)
    ref = hf_model(path)
    llm = LLM(model=str(path), max_model_len=512, num_kv_blocks=256)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    for ids in prompts[:3]:
        with torch.inference_mode():
            expected = ref(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(our_prompt_logits(path, ids), expected, atol=LOGIT_ATOL, rtol=0)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    for ids, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, ids, 32)


@pytest.mark.slow
def test_default_model_matches_transformers(default_model_path):
    ref = hf_model(default_model_path)
    llm = LLM(model="smollm2-135m-instruct", max_model_len=2048)
    tok = llm.get_tokenizer()
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "List three prime numbers."},
        ],
        [{"role": "user", "content": "Explain recursion in one sentence."}],
    ]
    prompts = [tok.encode_chat(c) for c in chats] + [tok.encode(p) for p in PROMPTS[:4]]
    with torch.inference_mode():
        expected = ref(torch.tensor([prompts[0]])).logits[0]
    torch.testing.assert_close(
        our_prompt_logits(default_model_path, prompts[0]), expected, atol=LOGIT_ATOL, rtol=0
    )
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    for ids, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, ids, 32)
    paris = llm.chat(chats[0], SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0]
    assert paris.text == "The capital of France is Paris."
    assert paris.finish_reason == "stop"
