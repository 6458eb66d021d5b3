"""The accuracy tools catch real errors: validate, the debugger, the KV check, snapshots and
the profiler, against transformers on the same weights.

Every "it passes" test has a twin where one layer's weights are perturbed in our model only
(transformers reads the checkpoint untouched): validate must fail there and the debugger must
name that layer.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import busy_engines

import neuron_runtime.loader as loader
from neuron_runtime import cli
from neuron_runtime.accuracy import (
    TOLERANCES,
    ModuleCapture,
    PromptSpec,
    SnapshotRecorder,
    Tolerance,
    Validator,
    check_request_kv,
    compare_kv,
    compare_logits,
    load_prompts,
    load_snapshot,
    load_snapshots,
    validate,
)
from neuron_runtime.accuracy.profiler import Profiler
from neuron_runtime.accuracy.teacher import Reference, Sample
from neuron_runtime.accuracy.validate import synthetic_image
from neuron_runtime.engine import LLMEngine
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.sampling_params import SamplingParams

FP32 = TOLERANCES["float32"]
SHORT = [PromptSpec("capital", "The capital of France is")]


def perturb_checkpoint_tensor(monkeypatch, name: str, scale: float = 0.1) -> None:
    """Our loader reads ``name`` with seeded noise added (``scale`` x its own std); the
    reference (transformers) reads the checkpoint itself."""
    read = loader.iter_weights

    def perturbed(*args, **kwargs):
        gen = torch.Generator().manual_seed(0)
        for key, tensor in read(*args, **kwargs):
            if key == name:
                noise = torch.randn(tensor.shape, generator=gen) * tensor.std() * scale
                tensor = tensor + noise
            yield key, tensor

    monkeypatch.setattr(loader, "iter_weights", perturbed)


# Metrics ------------------------------------------------------------------------------------


def test_logit_metrics_against_direct_formulas():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(6, 50, generator=gen) * 4
    ours = ref + torch.randn(6, 50, generator=gen) * 1e-5
    errors = compare_logits(ours, ref, FP32, k=5)
    assert all(e.passed and e.top1_match and e.topk == 1.0 for e in errors)
    kl = F.kl_div(
        ours.double().log_softmax(-1),
        ref.double().log_softmax(-1),
        log_target=True,
        reduction="none",
    ).sum(-1)
    for e, expected in zip(errors, kl.tolist(), strict=True):
        assert e.kl == pytest.approx(max(expected, 0.0), abs=1e-12)
        assert e.max_abs == pytest.approx(float((ours - ref)[e.position].abs().max()), rel=1e-6)
    # Position 2's best token demoted far below the rest: abs error, KL, top-1 and top-k fail.
    bad = ours.clone()
    bad[2, ref[2].argmax()] -= 30.0
    errors = compare_logits(bad, ref, FP32, k=5)
    assert [e.passed for e in errors] == [True, True, False, True, True, True]
    assert errors[2].top1_match is False and errors[2].topk == pytest.approx(0.8)
    assert errors[2].kl > 1.0


def test_topk_counts_near_ties_as_agreeing():
    ref = torch.tensor([[5.0, 4.0, 3.0, 2.0000, 1.99999, -1.0]])
    ours = ref.clone()
    ours[0, 4] += 2e-5  # swaps ranks 4 and 5 of a tie within the error
    (error,) = compare_logits(ours, ref, FP32, k=4)
    assert error.topk == 1.0 and error.passed


def test_tolerance_rejects_nonsense():
    with pytest.raises(ValueError, match="atol"):
        Tolerance(atol=-1, rtol=0, kl=0, topk=1, module_rtol=0)
    with pytest.raises(ValueError, match="topk"):
        Tolerance(atol=0, rtol=0, kl=0, topk=2, module_rtol=0)
    with pytest.raises(ValueError, match="dtype"):
        validate("smollm2-135m-instruct", dtype="int4")


# validate + debugger ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_validator(default_model_path):
    return Validator("smollm2-135m-instruct")


def test_default_model_validates_and_a_perturbed_layer_is_named(default_validator):
    report = default_validator.run(SHORT, max_new_tokens=4)
    assert report.passed, report.table()
    (sample,) = report.samples
    assert sample.num_tokens == sample.num_prompt_tokens + 4 and sample.kv.passed
    assert report.divergence is None
    # One layer's norm weight in our live model (not packed by the CPU kernels), 10% noise.
    weight = default_validator.ours.model.model.layers[7].post_attention_layernorm.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(
                1 + 0.1 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
            )
        bad = default_validator.run(SHORT, max_new_tokens=4)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert not bad.passed
    assert bad.samples[0].first_failure is not None
    divergence = bad.divergence
    assert divergence is not None and divergence.layer == "model.layers.7"
    # The norm runs fused into the residual add (no module call): the MLP reading it diverges.
    assert divergence.first.module == "model.layers.7.mlp.gate_up_proj"
    assert all(e.rel_error <= FP32.module_rtol for e in divergence.compared[:-1][:5])
    assert "FAIL" in bad.table() and "model.layers.7" in bad.table()


def test_cli_validate_exit_codes_json_and_snapshots(tiny_llama_path, tmp_path, monkeypatch):
    args = ["validate", "--model", str(tiny_llama_path), "--max-new-tokens", "3"]
    good = tmp_path / "good.json"
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*args, "--json", str(good)])
    assert exit_info.value.code == 0
    assert json.loads(good.read_text())["passed"] is True

    perturb_checkpoint_tensor(monkeypatch, "model.layers.1.self_attn.o_proj.weight")
    bad, snaps = tmp_path / "bad.json", tmp_path / "snaps"
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*args, "--json", str(bad), "--snapshot-dir", str(snaps)])
    assert exit_info.value.code == 1
    report = json.loads(bad.read_text())
    assert report["passed"] is False
    first = report["divergence"]["first_divergent_module"]
    assert first["module"] == "model.layers.1.self_attn.o_proj"
    assert first["reference"] == "model.layers.1.self_attn.o_proj"
    assert report["divergence"]["layer"] == "model.layers.1"
    # Layer 0 and the attention's input projection agree: the error starts at o_proj.
    names = [e["module"] for e in report["divergence"]["compared"]]
    assert names.index("model.layers.1.self_attn.qkv_proj") < names.index(first["module"])
    # The debugger compared what the snapshot loader reads back from both files.
    ours, ref = (
        load_snapshot(snaps / "ours.safetensors"),
        load_snapshot(snaps / "reference.safetensors"),
    )
    assert ours.metadata["side"] == "ours" and ref.metadata["side"] == "reference"
    assert "model.layers.1.self_attn.o_proj" in ours.modules
    assert "model.layers.1.self_attn.q_proj" in ref.modules


def test_every_family_validates_with_kv_and_no_divergence(tiny_family_path):
    validator = Validator(str(tiny_family_path))
    report = validator.run(max_new_tokens=3)
    assert report.passed, report.table()
    assert all(s.kv is not None and s.kv.passed for s in report.samples)
    sample = validator.samples(SHORT, 2)[0]
    from neuron_runtime.accuracy import find_divergence

    divergence = find_divergence(validator.ours, validator.reference, sample, FP32)
    assert divergence.first is None
    compared = {e.module for e in divergence.compared}
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp", "logits"} <= compared


def test_vision_model_validates_and_a_perturbed_vision_layer_is_named(tiny_llava_path, monkeypatch):
    report = validate("tiny-llava", max_new_tokens=3)
    assert report.passed, report.table()
    image_samples = [s for s in report.samples if s.name.startswith("image-")]
    assert len(image_samples) == 2 and all(s.num_prompt_tokens > 16 for s in image_samples)

    perturb_checkpoint_tensor(monkeypatch, "vision_tower.encoder.layers.1.mlp.fc2.weight")
    bad = validate("tiny-llava", max_new_tokens=3)
    assert not bad.passed
    # Text-only samples never touch the tower; the image samples fail.
    assert [s.passed for s in bad.samples] == [not s.name.startswith("image-") for s in bad.samples]
    assert bad.divergence.sample == "image-0"
    assert bad.divergence.first.module == "vision_tower.encoder.layers.1.mlp.fc2"
    assert bad.divergence.layer == "vision_tower.encoder.layers.1"


def test_encoder_model_validates_and_a_perturbed_layer_is_named(monkeypatch):
    report = validate("all-minilm-l6-v2")
    assert report.passed, report.table()
    assert report.samples[0].positions[0].kl is None  # hidden states: no distribution
    perturb_checkpoint_tensor(monkeypatch, "encoder.layer.2.output.dense.weight")
    bad = validate("all-minilm-l6-v2", prompts=SHORT)
    assert not bad.passed
    assert bad.divergence.first.module == "encoder.layer.2.output.dense"
    assert bad.divergence.layer == "encoder.layer.2"


def test_bfloat16_reference_uses_its_own_tolerances(tiny_llama_path):
    report = validate(str(tiny_llama_path), dtype="bfloat16", prompts=SHORT, max_new_tokens=2)
    assert report.tolerance == TOLERANCES["bfloat16"]
    assert report.passed, report.table()
    # Rounded to 8 mantissa bits, the reference is visibly farther than float32's 1e-5.
    assert report.samples[0].summary()["max_abs"] > 1e-4


def test_bf16_engine_validates_against_the_float32_reference(default_model_path):
    """``--engine-dtype bfloat16``: the engine's bf16 linear layers against transformers in
    fp32 on SmolLM2's weights, held to the bfloat16 tolerances; visibly not the fp32 engine."""
    from neuron_runtime.backends.cpu_kernels import kernels

    fused = kernels()
    if fused is None or not fused.has_bf16:
        pytest.skip("this CPU has no AVX512_BF16")
    report = validate("smollm2-135m-instruct", prompts=SHORT, engine_dtype="bfloat16")
    assert report.engine_dtype == "bfloat16" and report.tolerance == TOLERANCES["bfloat16"]
    assert report.passed, report.table()
    summary = report.samples[0].summary()
    assert summary["max_abs"] > TOLERANCES["float32"].atol
    assert summary["top1_agreement"] == 1.0


# KV check ---------------------------------------------------------------------------------------


def test_kv_check_on_a_real_request(tiny_llama_path, default_validator):
    engine = tiny_engine(tiny_llama_path)
    reference = Reference(tiny_llama_path, "LlamaForCausalLM")
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Name three rivers."}])
    assert len(prompt) > 2 * 16  # several KV blocks
    check = check_request_kv(engine, reference, prompt, FP32)
    assert check.passed and check.num_tokens == len(prompt), check
    assert check.max_abs < 1e-4
    stats = dataclasses.asdict(engine.stats())
    assert busy_engines([stats]) == [] and stats["num_kv_blocks_held"] == 0  # released
    assert stats["num_kv_exports"] == 1
    # The same comparison sees one corrupted value head in one layer of the runner's KV.
    ours, reference = default_validator.ours, default_validator.reference
    sample = Sample("kv", prompt, len(prompt))
    ours.logits(sample)
    kv = ours.export_kv(len(prompt))
    _, past = reference.logits_and_cache(sample)
    assert compare_kv(kv, past, FP32).passed
    kv[1, 5, 0] += 0.5
    bad = compare_kv(kv, past, FP32)
    assert not bad.passed and bad.worst_layer == 5 and bad.worst_tensor == "values"


# Snapshots ------------------------------------------------------------------------------------


def tiny_engine(path) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(model=str(path), max_model_len=128, num_kv_blocks=16)
    )


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    engine.add_request("r1", {"prompt_token_ids": prompt}, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    return final


def test_snapshots_round_trip_with_step_range_and_metadata(tiny_llama_path, tmp_path):
    engine = tiny_engine(tiny_llama_path)
    recorder = SnapshotRecorder(
        tmp_path, ["model.layers.*.mlp", "logits_head"], first_step=1, last_step=2
    ).attach(engine)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    out = run_one(engine, list(range(100, 120)), params)
    recorder.detach()
    assert "execute" not in vars(engine.runner)  # the runner's own method again
    snapshots = load_snapshots(tmp_path)
    assert [s.metadata["step"] for s in snapshots] == [1, 2]
    completion = out.outputs[0]
    for snap in snapshots:
        assert snap.metadata["request_ids"] == ["r1"] and snap.metadata["rank"] == 0
        assert snap.modules == ["model.layers.0.mlp", "model.layers.1.mlp", "logits_head"]
        assert snap.calls("model.layers.1.mlp")[0][0].shape == (1, 64)  # one decode row
        # The stored logits are the step's: their log-softmax at the sampled token is the
        # logprob the engine returned for it.
        step = snap.metadata["step"]
        (logits,) = snap.calls("logits_head")[0]
        token = completion.token_ids[step]
        expected = completion.logprobs[step][token]
        assert float(logits[0].log_softmax(-1)[token]) == pytest.approx(expected, abs=1e-5)
    assert recorder.bytes_written == sum(f.stat().st_size for f in recorder.files)


def test_snapshots_stop_at_their_byte_bound(tiny_llama_path, tmp_path):
    engine = tiny_engine(tiny_llama_path)
    # Each decode step's mlp output is 64 floats (256 bytes): room for three of them.
    recorder = SnapshotRecorder(tmp_path, ["model.layers.0.mlp"], max_bytes=3 * 256).attach(engine)
    run_one(
        engine,
        list(range(100, 104)),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    )
    recorder.detach()
    snapshots = load_snapshots(tmp_path)
    stored = sum(t.numel() * 4 for s in snapshots for t in s.tensors.values())
    assert stored <= 3 * 256 and len(snapshots) < 6


def test_module_capture_copies_outputs_modified_in_place():
    lin = torch.nn.Linear(4, 4)
    with ModuleCapture(torch.nn.Sequential(lin), ["0"]) as capture:
        out = lin(torch.ones(1, 4))
        expected = out.detach().clone()
        out.data.add_(1.0)  # the model writes into its own output later (fused adds)
    assert torch.equal(capture.outputs["0"][0][0], expected)


# Profiler ---------------------------------------------------------------------------------------


def test_cpu_profiler_writes_a_chrome_trace_and_top_ops(tiny_llama_path, tmp_path):
    engine = tiny_engine(tiny_llama_path)
    profiler = Profiler("cpu", tmp_path)
    with pytest.raises(ValueError, match="no profile"):
        profiler.stop()
    profiler.start()
    with pytest.raises(ValueError, match="already running"):
        profiler.start()
    run_one(engine, list(range(100, 120)), SamplingParams(temperature=0.0, max_tokens=3))
    result = profiler.stop()
    (trace,) = result.files
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
    assert "Self CPU" in result.summary
    with pytest.raises(ValueError, match="no profiler for device"):
        Profiler("tpu", tmp_path)


@pytest.mark.xla
def test_xla_profiler_writes_a_trace(tmp_path):
    pytest.importorskip("torch_xla")
    import torch_xla

    profiler = Profiler("xla", tmp_path)
    profiler.start()
    x = torch.ones(64, 64, device=torch_xla.device())
    assert (x @ x).sum().item() == 64**3
    result = profiler.stop()
    names = [f.name for f in result.files]
    assert any(n.endswith(".xplane.pb") for n in names)
    assert any(n.endswith(".trace.json.gz") for n in names)
    assert "CompileTime" in result.summary and "ExecuteTime" in result.summary


# Prompts ----------------------------------------------------------------------------------------


def test_prompts_files(tmp_path):
    synthetic_image(0).save(tmp_path / "a.png")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "<image>What is it?", "images": ["a.png"]}\n\n{"prompt": "Hi"}\n')
    specs = load_prompts(jsonl)
    assert [s.prompt for s in specs] == ["<image>What is it?", "Hi"]
    assert specs[0].images[0] == (tmp_path / "a.png").read_bytes() and specs[1].images == ()
    text = tmp_path / "p.txt"
    text.write_text("one\n\ntwo\n")
    assert [s.prompt for s in load_prompts(text)] == ["one", "two"]
    for content, error in [
        ("{not json", "not JSON"),
        ('{"text": "x"}', "expected"),
        ('{"prompt": "x", "images": ["missing.png"]}', "not found"),
    ]:
        jsonl.write_text(content)
        with pytest.raises(ValueError, match=error):
            load_prompts(jsonl)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["validate", "--prompts", str(tmp_path / "absent.txt")])
    assert exit_info.value.code == 2


def test_images_on_a_text_model_are_refused(default_validator):
    spec = PromptSpec("img", "<image>hi", (np.zeros((8, 8, 3), np.uint8),))
    with pytest.raises(ValueError, match="no vision tower"):
        default_validator.run([spec], max_new_tokens=0)
