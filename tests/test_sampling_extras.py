"""prompt_logprobs, allowed_token_ids and bad_words, against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from neuron_runtime import LLM, SamplingParams

LOGPROB_ATOL = 1e-3  # fp32 on both sides, different op order


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_llama_path).float().eval()


@pytest.fixture(scope="module")
def tiny(tiny_llama_path) -> LLM:
    # A 16-token step budget chunks every prompt below, so logprobs span several steps.
    return LLM(
        model=str(tiny_llama_path), max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=16
    )


PROMPT = list(range(100, 141))  # 41 tokens: three chunks


def test_prompt_logprobs_match_transformers_across_chunks(tiny, hf_tiny):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, n=2)
    (out,) = tiny.generate([{"prompt_token_ids": PROMPT}], params)
    with torch.no_grad():
        logits = hf_tiny(torch.tensor([PROMPT])).logits[0]
    expected = logits.log_softmax(-1)
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(PROMPT) and got[0] is None
    for pos in range(1, len(PROMPT)):
        entry = got[pos]
        ref = expected[pos - 1]
        assert entry[PROMPT[pos]] == pytest.approx(float(ref[PROMPT[pos]]), abs=LOGPROB_ATOL)
        top = ref.topk(3)
        assert set(top.indices.tolist()) <= set(entry)
        for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[token] == pytest.approx(value, abs=LOGPROB_ATOL)
    # Asking again is not served from the prefix cache: every position comes back again.
    (again,) = tiny.generate([{"prompt_token_ids": PROMPT}], params)
    assert again.prompt_logprobs is not None
    assert [e and e[PROMPT[i]] for i, e in enumerate(again.prompt_logprobs)] == pytest.approx(
        [e and e[PROMPT[i]] for i, e in enumerate(got)], abs=1e-5
    )
    assert tiny.engine.stats().num_kv_blocks_used == 0


def test_allowed_token_ids_greedy_equals_restricted_argmax(tiny, hf_tiny):
    allowed = [150, 151, 152, 153, 900, 4000]
    params = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed)
    (out,) = tiny.generate([{"prompt_token_ids": PROMPT[:10]}], params)
    ids = list(PROMPT[:10])
    mask = torch.full((hf_tiny.config.vocab_size,), float("-inf"))
    mask[allowed] = 0.0
    with torch.no_grad():
        for _ in range(8):
            logits = hf_tiny(torch.tensor([ids])).logits[0, -1]
            ids.append(int((logits + mask).argmax()))
    assert out.outputs[0].token_ids == ids[10:]


def test_bad_words_match_transformers_bad_words_ids(default_model_path):
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(default_model_path), max_model_len=256, num_kv_blocks=64)
    tokenizer = llm.get_tokenizer()
    question = [{"role": "user", "content": "What is the capital of France?"}]
    plain = llm.chat(question, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert "Paris" in plain.text
    words = ["Paris", "capital city"]
    banned = llm.chat(question, SamplingParams(temperature=0, max_tokens=12, bad_words=words))
    out = banned[0]
    assert "Paris" not in out.outputs[0].text
    hf = AutoModelForCausalLM.from_pretrained(default_model_path).float().eval()
    prompt = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        ref = hf.generate(
            prompt,
            max_new_tokens=12,
            do_sample=False,
            bad_words_ids=tokenizer.bad_words_token_ids(words),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )[0, prompt.shape[1] :].tolist()
    assert out.outputs[0].token_ids == ref


def test_invalid_extras_raise_naming_the_field(tiny):
    for bad, field in (
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    vocab = tiny.engine.config.model.vocab_size
    with pytest.raises(ValueError, match="allowed_token_ids"):
        tiny.generate([{"prompt_token_ids": [5]}], SamplingParams(allowed_token_ids=[vocab]))
    assert tiny.engine.stats().num_unfinished_outputs == 0
