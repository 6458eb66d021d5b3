"""A decode step in one kernel call (backends/cpu_decode.py) against the model's modules.

Every decode step of a generation runs both ways on the same KV cache: the modules (the path
the rest of the suite checks against transformers) and then ``decode_step``; the hidden
states and logits must be the same bits. The steps the one call must not take (prefills,
prompt logprobs, a forward hook, a model off the Llama path) must run the modules.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import TINY_FAMILIES, make_tiny_model

from neuron_runtime import LLM, SamplingParams
from neuron_runtime.backends.cpu_decode import DecodeStep, runs_llama_path
from neuron_runtime.backends.cpu_kernels import kernels
from neuron_runtime.model_runner import ModelRunner, StepInputs

DEFAULT = "smollm2-135m-instruct"
PROMPTS = [
    "Write a haiku about the sea.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,",
    "Why?",
    "List three colours of the rainbow, then explain why the sky is blue in one line.",
]


class BothWays:
    """Wraps ``runner.forward``: a step the one call takes runs through the modules first,
    then through ``decode_step``, and the two results are compared; other steps are counted."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.forward = runner.forward
        self.compared = self.module_steps = 0
        self.mismatches: list[str] = []

    def __call__(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        runner = self.runner
        if not runner._runs_fused(step):
            self.module_steps += 1
            return self.forward(step)
        fused, runner.fused_decode = runner.fused_decode, None
        try:
            hidden, logits = self.forward(step)  # the modules: writes this step's KV
        finally:
            runner.fused_decode = fused
        hidden2, logits2 = self.forward(step)  # decode_step: the same KV again
        rows = len(step.input_ids)
        if not (torch.equal(hidden, hidden2) and torch.equal(logits, logits2)):
            diff = (logits - logits2).abs().max().item()
            self.mismatches.append(f"{rows} rows: logits differ by up to {diff}")
        self.compared += 1
        return hidden2, logits2


def generate_both_ways(llm: LLM, max_tokens: int = 24, **params: Any) -> BothWays:
    runner = llm.engine.runner
    assert isinstance(runner.fused_decode, DecodeStep)
    both = runner.forward = BothWays(runner)  # type: ignore[method-assign]
    tok = llm.get_tokenizer()
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    try:
        llm.generate([{"prompt_token_ids": tok.encode(p)} for p in PROMPTS], sampling)
    finally:
        del runner.forward
    return both


def test_decode_step_is_the_modules_bits_on_the_default_model(k):
    """SmolLM2 fp32 on 1 and 2 threads; contexts of different lengths cross block edges."""
    llm = LLM(model=DEFAULT, max_model_len=256, num_threads=k.num_threads(), block_size=8)
    both = generate_both_ways(llm)
    assert both.compared >= 20 and not both.mismatches, both.mismatches


@pytest.mark.skipif(
    kernels() is None or not kernels().has_bf16,  # type: ignore[union-attr]
    reason="bf16 panels need AVX512_BF16",
)
def test_decode_step_is_the_modules_bits_with_bf16_panels():
    llm = LLM(model=DEFAULT, max_model_len=256, dtype="bfloat16", block_size=8)
    both = generate_both_ways(llm, max_tokens=12)
    assert both.compared >= 8 and not both.mismatches, both.mismatches


def test_decode_step_is_the_modules_bits_on_gguf_blocks():
    """Q4_1 decoder layers and a Q8_0 logits head."""
    llm = LLM(model=DEFAULT, max_model_len=256, quantization="gguf", block_size=8)
    assert llm.engine.runner.model.logits_head.quantized[1].format == "q8_0"
    both = generate_both_ways(llm, max_tokens=12)
    assert both.compared >= 8 and not both.mismatches, both.mismatches


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_decode_step_is_the_modules_bits_on_llama_path_families(
    family, tmp_path, default_model_path
):
    """Qwen2's q/k/v biases, Mistral's sliding window (8 positions, shorter than the
    contexts here), one KV head; tiny random checkpoints with perturbed norms and biases."""
    architecture, settings = TINY_FAMILIES[family]
    path = make_tiny_model(tmp_path, default_model_path, architecture, settings, True)
    llm = LLM(model=str(path), max_model_len=256, block_size=4)
    both = generate_both_ways(llm, max_tokens=20)
    assert both.compared >= 16 and not both.mismatches, both.mismatches


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_models_off_the_llama_path_run_their_modules(family, tmp_path, default_model_path):
    """Gemma 3 (scaled norms, GELU, logit softcap) and Qwen3 (q/k norms in ``rotate_qk``)."""
    architecture, settings = TINY_FAMILIES[family]
    path = make_tiny_model(tmp_path, default_model_path, architecture, settings, True)
    llm = LLM(model=str(path), max_model_len=128)
    runner = llm.engine.runner
    assert not runs_llama_path(runner.model) and runner.fused_decode is None
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_path) -> LLM:
    return LLM(model=str(tiny_llama_path), max_model_len=128, block_size=4)


def test_a_model_whose_layers_differ_in_eps_or_scale_runs_its_modules(tiny_llm):
    """The structs hold one norm eps and one attention scale for the whole model."""
    model = tiny_llm.engine.runner.model
    assert runs_llama_path(model)
    for module, name in (
        (model.model.layers[1].input_layernorm, "eps"),
        (model.model.layers[0].self_attn, "scale"),
    ):
        before = getattr(module, name)
        setattr(module, name, before * 2)
        try:
            assert not runs_llama_path(model)
        finally:
            setattr(module, name, before)
    assert runs_llama_path(model)


def test_steps_that_need_the_modules_run_them(tiny_llm):
    """A forward hook sees every step; prompt logprobs and prefills run the modules; once
    the hook is gone the decode steps take the one call again."""
    runner = tiny_llm.engine.runner
    seen: list[int] = []
    handle = runner.model.model.layers[1].register_forward_hook(
        lambda _m, args, _out: seen.append(args[0].shape[0])
    )
    try:
        both = generate_both_ways(tiny_llm, max_tokens=6)
    finally:
        handle.remove()
    assert both.compared == 0 and both.module_steps == 6 and len(seen) == 6
    both = generate_both_ways(tiny_llm, max_tokens=6, prompt_logprobs=1)
    # The prompts' step (with their logprobs) runs the modules, the decodes the one call.
    assert both.module_steps == 1 and both.compared == 5 and not both.mismatches
    assert tiny_llm.engine.stats().num_running == 0


def test_steps_while_kv_reads_land_run_the_modules(tiny_llm):
    """While layer-wise KV reads land (a decode replica's NIXL handoff), each attention layer
    first waits for its own layer's blocks: a hook the one call would skip."""
    with tiny_llm.engine.runner.kv_arriving([]):
        both = generate_both_ways(tiny_llm, max_tokens=4)
    assert both.compared == 0 and both.module_steps == 4
    assert generate_both_ways(tiny_llm, max_tokens=4).compared == 3


def test_a_repacked_weight_rebuilds_the_step(tiny_llm):
    """A layer whose panels are replaced (weights reloaded, repacked) is not read through
    the old pointers: the next step builds the structs again, on the new panels."""
    runner = tiny_llm.engine.runner
    old = runner.fused_decode
    layer = runner.model.model.layers[0].mlp.down_proj
    layer.packed = layer.packed.clone()
    assert not old.current(runner.kv_caches)
    both = generate_both_ways(tiny_llm, max_tokens=6)
    assert runner.fused_decode is not old and runner.fused_decode.current(runner.kv_caches)
    assert both.compared == 5 and not both.mismatches


def test_rows_out_of_range_are_refused_before_any_kernel_runs(tiny_llm):
    """A token id past the embedding or a position past the rotary table raises (the
    modules' path raises on both too), before anything is written to the KV cache."""
    runner = tiny_llm.engine.runner
    step = runner.fused_decode
    vocab, positions = runner.model.model.embed_tokens.weight.shape[0], 1024
    caches = [c.clone() for pair in runner.kv_caches for c in pair]
    with pytest.raises(ValueError, match="token id past the embedding"):
        step([1, vocab], [0, 0], [0, 1], [[0], [0]], [1, 1])
    with pytest.raises(ValueError, match="position past the rotary table"):
        step([1], [positions], [0], [[0]], [1])
    with pytest.raises(ValueError, match="token id past the embedding"):
        step([-1], [0], [0], [[0]], [1])
    after = [c for pair in runner.kv_caches for c in pair]
    assert all(torch.equal(a, b) for a, b in zip(caches, after, strict=True))
