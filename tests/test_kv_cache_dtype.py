"""``kv_cache_dtype="bfloat16"``: keys and values stored rounded to bf16, read back widened.

References: torch's own rounding (``Tensor.to``), the torch ops path and the fp32-cache engine;
against transformers' fp32 model
on the same weights in test_cpu_bf16.py (``test_bf16_engine_stays_close_to_transformers_fp32``),
and decode attention (against float64) and both CPU attention paths on a bf16 cache in
test_cpu_kernels.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_cpu_decode_step import generate_both_ways
from test_kv_transfer import PROMPTS, batch, continue_all, engine, greedy, hand_off, run_all

from neuron_runtime import LLM, EngineArgs, SamplingParams
from neuron_runtime.backends import cpu
from neuron_runtime.backends.ops import TORCH_OPS
from neuron_runtime.config import ModelConfig
from neuron_runtime.kv_budget import num_kv_blocks
from neuron_runtime.kv_transfer import KVTransferError, model_fingerprint
from neuron_runtime.layers.attention import (
    write_kv,
)

DEFAULT = "smollm2-135m-instruct"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def same_bf16(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, NaN payloads aside (any NaN is a NaN)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(bits(a)[~nan], bits(b)[~nan])


def test_write_kv_rounds_as_torch_does(k):
    """Random values, exact ties (to even), NaN, infinities, signed zeros and denormals."""
    g = torch.Generator().manual_seed(1)
    rows, kvh, heads, d, bs, num_blocks = 9, 2, 4, 64, 4, 8
    qkv = torch.randn(rows, heads + 2 * kvh, d, generator=g)
    special = torch.tensor(
        [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), float("nan"), float("inf"), -float("inf"),
         -0.0, 1e-40, 3.0e38, 1 + 2**-9]
    )  # fmt: skip
    qkv[0, heads, : len(special)] = special
    qkv[1, heads + kvh, : len(special)] = special
    kk, vv = qkv[:, heads : heads + kvh], qkv[:, heads + kvh :]  # strided rows
    slots = torch.tensor(random.Random(2).sample(range(num_blocks * bs), rows))
    caches = []
    for fused in (None, k):
        kc = torch.zeros(kvh, num_blocks, bs, d, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        if fused is None:
            write_kv(kc, slots, kk)
            write_kv(vc, slots, vv)
        else:
            fused.write_kv(kk, vv, kc, vc, slots)
        caches.append((kc, vc))
    (tk, tv), (fk, fv) = caches
    assert same_bf16(tk, fk) and same_bf16(tv, fv)
    assert fk.isnan().sum() == 1 and fk.isinf().sum() == 2
    # The rounding happened: ties went to even, and the cache is not the fp32 values.
    flat = fk.view(kvh, -1, d)[0, slots[0], :3].float()
    assert flat.tolist() == [1.0, 1 + 4 * 2**-8, -1.0]


def test_a_bf16_cache_holds_twice_the_tokens_of_a_budget():
    configs = {
        dtype: EngineArgs(
            model=DEFAULT, max_model_len=256, kv_cache_memory_bytes=64 << 20, kv_cache_dtype=dtype
        ).create_engine_config()
        for dtype in ("float32", "bfloat16")
    }
    assert num_kv_blocks(configs["bfloat16"]) == 2 * num_kv_blocks(configs["float32"])
    auto = EngineArgs(model=DEFAULT, max_model_len=256, kv_cache_memory_bytes=64 << 20)
    assert auto.create_engine_config().model.kv_cache_dtype == "float32"
    # "auto" follows dtype, as vLLM's does (the bf16 linear layers need AVX512_BF16 to run,
    # not to be configured).
    auto.dtype = "bfloat16"
    assert auto.create_engine_config().model.kv_cache_dtype == "bfloat16"


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of float32, bfloat16"):
        EngineArgs(
            model=DEFAULT, max_model_len=256, kv_cache_dtype="float16"
        ).create_engine_config()


def test_kv_cache_dtypes_fingerprint_their_kv_apart():
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8}
    fp32 = ModelConfig(path="here", hf_config=config, max_model_len=8)
    bf16 = ModelConfig(path="here", hf_config=config, max_model_len=8, kv_cache_dtype="bfloat16")
    assert model_fingerprint(fp32) != model_fingerprint(bf16)


@pytest.fixture(scope="module")
def bf16_cache_llm() -> LLM:
    return LLM(model=DEFAULT, max_model_len=256, kv_cache_dtype="bfloat16", block_size=8)


def test_decode_step_is_the_modules_bits_on_a_bf16_cache(bf16_cache_llm):
    runner = bf16_cache_llm.engine.runner
    assert all(c.dtype == torch.bfloat16 for layer in runner.kv_caches for c in layer)
    both = generate_both_ways(bf16_cache_llm, max_tokens=12)
    assert both.compared >= 8 and not both.mismatches, both.mismatches


def test_a_prefix_hit_gives_the_cold_runs_bits(bf16_cache_llm):
    """On the CPU kernels a prompt's rows attend in the decodes' kernel call over the keys the
    cache holds, whether its prefix was found in the prefix cache or computed in the same
    step: the same bf16 keys, the same sums, the same logprobs to the bit. (Through torch's
    SDPA the two paths differ by one part in 1e7, enough to tip a key to the neighbouring bf16
    value: logprobs then differed by up to 8e-3.)"""
    tok = bf16_cache_llm.get_tokenizer()
    prompt = tok.encode(PROMPTS[3] + " " + PROMPTS[2])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    cold = LLM(
        model=DEFAULT,
        max_model_len=256,
        kv_cache_dtype="bfloat16",
        block_size=8,
        enable_prefix_caching=False,
    ).generate([{"prompt_token_ids": prompt}], params)[0]
    bf16_cache_llm.generate([{"prompt_token_ids": prompt[:40]}], greedy(1))  # caches 5 blocks
    hit = bf16_cache_llm.generate([{"prompt_token_ids": prompt}], params)[0]
    assert hit.num_cached_tokens == 40

    def logprobs(out) -> torch.Tensor:  # noqa: ANN001
        completion = out.outputs[0]
        steps = zip(completion.token_ids, completion.logprobs, strict=True)
        return torch.tensor([step[token] for token, step in steps])

    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
    assert torch.equal(logprobs(hit), logprobs(cold))


def test_torch_ops_on_a_bf16_cache_give_the_kernels_tokens(monkeypatch, bf16_cache_llm):
    tok = bf16_cache_llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(p)} for p in PROMPTS[:4]]
    expected = bf16_cache_llm.generate(prompts, greedy(16))
    monkeypatch.setattr(cpu, "kernels", lambda: None)
    llm = LLM(model=DEFAULT, max_model_len=256, kv_cache_dtype="bfloat16", block_size=8)
    assert llm.engine.runner.ops is TORCH_OPS
    for got, want in zip(llm.generate(prompts, greedy(16)), expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_handoff_between_bf16_cache_engines_equals_one_engine(default_model_path):
    """The payload carries the cache's values in fp32 exactly; the decode engine stores them
    back without rounding. An fp32-cache engine refuses that KV."""
    prefill = engine(default_model_path, kv_cache_dtype="bfloat16")
    decode = engine(default_model_path, kv_cache_dtype="bfloat16", block_size=8, num_kv_blocks=256)
    reference = engine(default_model_path, kv_cache_dtype="bfloat16")
    params = [greedy(8 + 4 * i) for i in range(len(PROMPTS))]
    expected = run_all(reference, batch("r", PROMPTS, params))
    pre = hand_off(prefill, PROMPTS, params)
    payload = pre[0].kv_handoff.kv
    assert torch.equal(
        torch.from_numpy(payload.kv).bfloat16().float(), torch.from_numpy(payload.kv)
    )
    dec = continue_all(decode, PROMPTS, params, [pre[i].kv_handoff for i in pre])
    for i in range(len(PROMPTS)):
        assert dec[i].outputs[0].token_ids == expected[f"r{i}"].outputs[0].token_ids, PROMPTS[i]
    fp32 = engine(default_model_path)
    with pytest.raises(KVTransferError, match="config_hash"):
        payload.check(fp32.config.model, pre[0].prompt_token_ids)
