"""``dtype="bfloat16"``: the linear layers and the logits head on bf16 panels (VDPBF16PS, fp32
sums) where the CPU has AVX512_BF16, checked against float64 products of the same bf16 values
and, for the whole engine, against transformers' fp32 model on the same weights (so is an
engine with a bf16 KV cache, ``kv_cache_dtype``).

On a CPU without AVX512_BF16 the bf16 panel tests skip; the refusals and the KV cache's run
everywhere.
"""

from __future__ import annotations

import pytest
import torch
from test_llama_vs_hf import hf_greedy, hf_model

from neuron_runtime import LLM, EngineArgs, SamplingParams
from neuron_runtime.backends import cpu, cpu_kernels
from neuron_runtime.backends.base import get_backend
from neuron_runtime.config import ModelConfig
from neuron_runtime.kv_transfer import model_fingerprint

FUSED = cpu_kernels.kernels()
needs_bf16 = pytest.mark.skipif(
    FUSED is None or not FUSED.has_bf16, reason="this CPU has no AVX512_BF16"
)


def bf16_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T + b`` in float64 on the bf16-rounded ``x`` and ``w`` (the bias stays fp32)."""
    y = x.bfloat16().double() @ w.bfloat16().double().T
    return y if b is None else y + b.double()


# Every row count a tile takes (8, 4, 2, 1 and their sums), more than one row block, panels
# cut short, the smallest even width.
@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 15, 16, 23, 64, 77, 130])
@pytest.mark.parametrize("width,out", [(2, 1), (64, 67), (130, 33), (576, 100)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_matches_float64_products_of_the_bf16_values(k, rows, width, out, bias):
    g = torch.Generator().manual_seed(rows * 1000 + width + out)
    x = torch.randn(rows, width, generator=g)
    w = torch.randn(out, width, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    got = k.linear(x, k.pack_bf16(w), b, out)
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    expected = bf16_reference(x, w, b)
    # Each product of two bf16 values is exact in fp32: what is left is the fp32 rounding
    # of the sums, relative to the sum of the products' magnitudes.
    scale = x.bfloat16().double().abs() @ w.bfloat16().double().abs().T
    assert ((got.double() - expected).abs() <= 1e-6 * scale + 1e-6).all()
    # And it is not the fp32 product: the bf16 rounding shows at this width.
    if width >= 64:
        assert not torch.allclose(got, x @ w.T + (0 if b is None else b), atol=1e-4, rtol=0)


@needs_bf16
@pytest.mark.parametrize("rows", [3, 9, 16, 77])
def test_bf16_linear_row_is_the_same_alone_or_in_a_batch(k, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g)
    w = k.pack_bf16(torch.randn(1536, 576, generator=g))
    batch = k.linear(x, w, None, 1536)
    for r in range(rows):
        assert torch.equal(k.linear(x[r : r + 1].contiguous(), w, None, 1536)[0], batch[r])


def test_bf16_panels_refuse_an_odd_width():
    with pytest.raises(ValueError, match="even input width"):
        cpu_kernels.CPUKernels.pack_bf16(torch.randn(4, 7))


def test_bf16_is_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        EngineArgs(dtype="float16").create_engine_config()
    for args in (dict(device="cuda"), dict(graph_mode="inductor")):
        with pytest.raises(ValueError, match="runs on the CPU kernels"):
            EngineArgs(dtype="bfloat16", **args).create_engine_config()
    with pytest.raises(ValueError, match="graph_mode 'eager' only"):
        get_backend("cpu", 1, "inductor", "bfloat16")
    # A CPU without AVX512_BF16 (or no kernels): a clear error, never an emulated path.
    monkeypatch.setattr(cpu, "kernels", lambda: None)
    with pytest.raises(ValueError, match="AVX512_BF16; the kernels are off here"):
        cpu.CPUBackend(1, dtype="bfloat16")


def test_bf16_engines_fingerprint_their_kv_apart():
    # KV from a bf16 prefill must not be imported by an fp32 decode engine, nor the reverse.
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8}
    fp32 = ModelConfig(path="here", hf_config=config, max_model_len=8)
    bf16 = ModelConfig(path="here", hf_config=config, max_model_len=8, dtype="bfloat16")
    assert model_fingerprint(fp32) != model_fingerprint(bf16)
    assert model_fingerprint(fp32) == model_fingerprint(
        ModelConfig(path="elsewhere", hf_config=dict(config), max_model_len=8)
    )


def prompt_token_logprobs(out) -> list[float]:  # noqa: ANN001
    """The logprob the engine gave each prompt token after the first."""
    ids = out.prompt_token_ids
    return [step[ids[i]] for i, step in enumerate(out.prompt_logprobs) if step is not None]


def worst_prompt_logprob_error(ref, llm: LLM, prompts: list[list[int]]) -> float:  # noqa: ANN001
    """The largest distance between the engine's prompt-token logprobs and those of
    transformers' model ``ref`` (float64 log-softmax of its logits), over ``prompts``."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    worst = 0.0
    for ids, out in zip(prompts, outputs, strict=True):
        with torch.inference_mode():
            logits = ref(torch.tensor([ids])).logits[0].double()
        expected = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), ids[1:]]
        got = torch.tensor(prompt_token_logprobs(out), dtype=torch.float64)
        worst = max(worst, (got - expected).abs().max().item())
    return worst


@pytest.mark.slow
@pytest.mark.parametrize(
    "knob,bound,tokens",
    [
        # bf16 inputs and weights (8 mantissa bits; the KV cache follows dtype, "auto")
        ("dtype", 0.25, 4),
        # fp32 linear layers, keys and values stored in bf16 (test_kv_cache_dtype.py)
        ("kv_cache_dtype", 0.1, 8),
    ],
)
def test_bf16_engine_stays_close_to_transformers_fp32(default_model_path, knob, bound, tokens):
    """The default model's prompt logprobs and greedy tokens with bf16 linear layers or a bf16
    KV cache, against transformers' fp32 model on the same weights; the fp32 engine is the
    yardstick."""
    if knob == "dtype" and (FUSED is None or not FUSED.has_bf16):
        pytest.skip("this CPU has no AVX512_BF16")
    ref = hf_model(default_model_path)
    engines = {
        dtype: LLM(model="smollm2-135m-instruct", max_model_len=512, num_threads=2, **{knob: dtype})
        for dtype in ("float32", "bfloat16")
    }
    tok = engines["float32"].get_tokenizer()
    texts = [
        "The capital of France is Paris, and the capital of Germany is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    ]
    prompts = [tok.encode(t) for t in texts]
    error = {dtype: worst_prompt_logprob_error(ref, llm, prompts) for dtype, llm in engines.items()}
    assert error["float32"] < 1e-3
    # 8 mantissa bits move a logprob by a few hundredths of a nat, far more than fp32's
    # reordered sums and far less than a wrong layer would.
    assert 10 * error["float32"] < error["bfloat16"] < bound
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outputs = engines["bfloat16"].generate([{"prompt_token_ids": p} for p in prompts], greedy)
    # Clear greedy picks survive the rounding: the first tokens are transformers' fp32 ones.
    for ids, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, ids, tokens)
