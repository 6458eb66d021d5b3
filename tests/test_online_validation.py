"""Online validation (neuron_runtime/accuracy/online.py): live requests' prompt logits checked
against transformers off the engine loop.

The engine-level tests run the real default model with a validator attached: its checks pass,
the logits it kept are the ones the first token was sampled from and equal transformers' own
(computed here, apart from the validator's reference); with one layer's weights perturbed in
the engine only, the check fails and its warning names the request. The serve test runs a
colocated app with ``accuracy.sample_rate`` 1.0 and reads the counters from Ray's metrics port.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import busy_engines, make_tiny_llama

from neuron_runtime.accuracy.online import OnlineValidationConfig, OnlineValidator
from neuron_runtime.engine import LLMEngine
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.sampling_params import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams):
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    return final


def test_config_is_checked():
    with pytest.raises(ValueError, match="sample_rate"):
        OnlineValidationConfig(sample_rate=1.5)
    with pytest.raises(ValueError, match="dtype"):
        OnlineValidationConfig(dtype="int8")
    with pytest.raises(ValueError, match="accuracy: tolerance atol"):
        OnlineValidationConfig(atol=-1.0)
    with pytest.raises(ValueError, match="max_queue"):
        OnlineValidationConfig(max_queue=0)
    config = OnlineValidationConfig(sample_rate=0.5, kl=1e-3)
    assert config.tolerance.kl == 1e-3 and config.tolerance.atol == 1e-3  # float32's atol


def test_the_app_config_is_checked_at_the_edge():
    from pydantic import ValidationError

    from app.builder import BuildArgs

    with pytest.raises(ValidationError, match=r"accuracy\.sample_rate\n.*less than or equal to 1"):
        BuildArgs(accuracy={"sample_rate": 1.5})
    with pytest.raises(ValidationError, match=r"accuracy\.tolerance\n.*Extra inputs"):
        BuildArgs(accuracy={"sample_rate": 0.1, "tolerance": 1e-3})
    assert BuildArgs().accuracy.config() is None  # off: nothing is built
    config = BuildArgs(accuracy={"sample_rate": 0.1, "dtype": "bfloat16"}).accuracy.config()
    assert config == OnlineValidationConfig(sample_rate=0.1, dtype="bfloat16")


def test_a_full_queue_drops_and_counts():
    drops = []
    # No worker: nothing takes checks off the queue of one.
    validator = OnlineValidator(
        OnlineValidationConfig(sample_rate=1.0, max_queue=1), on_drop=lambda: drops.append(1)
    )
    logits = np.zeros(8, dtype=np.float32)
    assert validator.submit("a", [1, 2], logits)
    assert not validator.submit("b", [1, 2], logits)
    stats = validator.stats()
    assert (stats.checks, stats.dropped, stats.pending) == (0, 1, 1) and drops == [1]


def test_sampling_follows_the_rate():
    draws = OnlineValidator(OnlineValidationConfig(sample_rate=0.25, seed=0))
    share = sum(draws.wants() for _ in range(4000)) / 4000
    assert 0.22 < share < 0.28
    assert not any(OnlineValidator(OnlineValidationConfig()).wants() for _ in range(100))


@pytest.fixture(scope="module")
def engine(default_model_path) -> LLMEngine:
    # A 16-token step budget: the chat prompt's prefill runs in several chunks.
    return LLMEngine.from_engine_args(
        EngineArgs(
            model="smollm2-135m-instruct",
            max_model_len=256,
            num_kv_blocks=32,
            max_num_batched_tokens=16,
        )
    )


def test_checks_pass_on_the_default_model_and_fail_with_a_perturbed_layer(
    engine, default_model_path, caplog
):
    import transformers

    checks, kept = [], {}
    validator = OnlineValidator(
        OnlineValidationConfig(sample_rate=1.0), on_check=checks.append
    ).attach(engine)
    submit = validator.submit

    def spy(request_id, prompt_token_ids, logits):
        kept[request_id] = logits.copy()
        return submit(request_id, prompt_token_ids, logits)

    validator.submit = spy  # type: ignore[method-assign]
    baseline = dataclasses.asdict(engine.stats())
    prompt = engine.tokenizer.encode_chat(QUESTION)
    assert len(prompt) > 2 * 16  # prefilled in chunks
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
    try:
        out = run(engine, "good", prompt, params)
        assert out.outputs[0].text.startswith("The capital of France is Paris")
        assert validator.wait_idle(60)
        (check,) = checks
        assert check.request_id == "good" and check.passed and check.top1_match
        assert check.num_prompt_tokens == len(prompt)
        assert check.max_abs < 1e-3 and check.kl < 1e-6
        # The kept row is the one the first token was sampled from ...
        first = out.outputs[0].token_ids[0]
        logprob = torch.from_numpy(kept["good"]).double().log_softmax(-1)[first]
        # (the engine's log_softmax runs in fp32 over 49152 logits: ~1e-5 of rounding, more
        # with 8-lane AVX2 sums than with 16-lane AVX-512 ones)
        assert float(logprob) == pytest.approx(out.outputs[0].logprobs[0][first], abs=1e-4)
        # ... and the check's error is its distance from transformers' logits, computed here
        # over every position (the validator keeps only the last: fp32 rounding differs, by
        # ~1e-6 with logits up to ~30).
        hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_path).eval()
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).logits[0, -1]
        del hf
        error = float((torch.from_numpy(kept["good"]) - expected).abs().max())
        assert check.max_abs == pytest.approx(error, abs=1e-5)

        # One layer's norm weight in the engine's live model, 10% noise; the reference reads
        # the checkpoint untouched.
        weight = engine.runner.model.model.layers[7].post_attention_layernorm.weight
        saved = weight.detach().clone()
        noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
        try:
            with torch.no_grad():
                weight.mul_(1 + 0.1 * noise)
            with caplog.at_level(logging.WARNING, logger="neuron_runtime.accuracy.online"):
                run(engine, "perturbed-7", prompt, SamplingParams(temperature=0.0, max_tokens=2))
                assert validator.wait_idle(60)
        finally:
            with torch.no_grad():
                weight.copy_(saved)
        bad = checks[-1]
        assert bad.request_id == "perturbed-7" and not bad.passed
        assert bad.max_abs > 1e-2
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "request perturbed-7 is past tolerance" in warnings[0].message
        stats = validator.stats()
        assert (stats.checks, stats.failures, stats.dropped, stats.pending) == (2, 1, 0, 0)
    finally:
        validator.close()
        engine.online_validation = None
    assert engine.runner.prompt_logit_taps == {}
    after = dataclasses.asdict(engine.stats())
    assert busy_engines([after]) == [] and after["num_kv_blocks_held"] == 0
    assert {k: after[k] for k in ("num_running", "num_waiting")} == {
        k: baseline[k] for k in ("num_running", "num_waiting")
    }


def test_the_prefill_role_is_checked_before_its_handoff(engine):
    checks = []
    validator = OnlineValidator(
        OnlineValidationConfig(sample_rate=1.0), on_check=checks.append
    ).attach(engine)
    prompt = engine.tokenizer.encode("The old lighthouse keeper climbed the spiral stairs")
    try:
        engine.add_request(
            "prefill-1", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4), export_kv=True
        )
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        assert final.kv_handoff is not None
        assert engine.release_kv(final.kv_handoff.handoff_id)
        assert validator.wait_idle(60)
    finally:
        validator.close()
        engine.online_validation = None
    (check,) = checks
    assert check.request_id == "prefill-1" and check.passed
    assert check.num_prompt_tokens == len(prompt)
    assert engine.stats().num_kv_blocks_held == 0


def test_a_reference_that_does_not_load_drops_every_check(engine, monkeypatch, caplog):
    import neuron_runtime.accuracy.teacher as teacher

    def broken(*args, **kwargs):
        raise OSError("no weights here")

    monkeypatch.setattr(teacher, "Reference", broken)
    drops = []
    with caplog.at_level(logging.ERROR, logger="neuron_runtime.accuracy.online"):
        validator = OnlineValidator(
            OnlineValidationConfig(sample_rate=1.0), on_drop=lambda: drops.append(1)
        ).attach(engine)
    try:
        assert "online validation is off" in caplog.text
        out = run(engine, "served", list(range(100, 120)), SamplingParams(max_tokens=2))
        assert out.finished and len(out.outputs[0].token_ids) == 2  # serving goes on
        assert validator.wait_idle(10)
    finally:
        validator.close()
        engine.online_validation = None
    stats = validator.stats()
    assert (stats.checks, stats.dropped, stats.pending) == (0, 1, 0) and drops == [1]


def test_an_aborted_or_unsampled_request_leaves_no_tap(engine):
    validator = OnlineValidator(OnlineValidationConfig(sample_rate=1.0))
    engine.online_validation = validator  # no worker: nothing may reach the queue
    try:
        engine.add_request("gone", {"prompt_token_ids": list(range(100, 140))}, SamplingParams())
        assert engine.runner.prompt_logit_taps == {"gone": 40}
        engine.abort_request("gone")
        assert engine.runner.prompt_logit_taps == {}
        engine.online_validation = None  # off: nothing is tapped
        run(engine, "plain", list(range(100, 120)), SamplingParams(max_tokens=2))
        assert engine.runner.prompt_logit_taps == {} and validator.stats().pending == 0
    finally:
        engine.online_validation = None


# Serve -----------------------------------------------------------------------------------------

APP = "online-validation"


@pytest.mark.ray
def test_a_colocated_app_exports_its_checks(serve_cluster, tmp_path_factory, default_model_path):
    openai = pytest.importorskip("openai")
    import ray
    from ray import serve
    from test_ray_metrics_endpoint import samples

    from app.builder import BuildArgs, build_openai_app

    # A fresh tiny model: its path is the model_name label no other test's replica has.
    model_path: Path = make_tiny_llama(tmp_path_factory.mktemp("online-model"), default_model_path)
    args = BuildArgs(
        model=str(model_path),
        max_model_len=256,
        embedding_model=None,
        engine_args={"num_kv_blocks": 64},
        accuracy={"sample_rate": 1.0},
    )
    llm_options = {
        "ray_actor_options": {
            "num_cpus": 0.1,
            "runtime_env": {"env_vars": {"RAY_metrics_report_interval_ms": "1000"}},
        },
    }
    app = build_openai_app(
        args, llm_options=llm_options, ingress_options={"ray_actor_options": {"num_cpus": 0.1}}
    )
    serve.run(app, name=APP, route_prefix=f"/{APP}")
    try:
        api = openai.OpenAI(
            base_url=f"{serve_cluster}/{APP}/v1", api_key="unused", max_retries=0, timeout=60
        )
        api.completions.create(
            model=str(model_path), prompt="Count to three:", max_tokens=4, temperature=0
        )
        node = ray._private.worker.global_worker.node
        url = f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"
        ours = {"deployment": "LLMServer", "model_name": str(model_path)}
        names = {
            "checks": "ray_neuron_online_validation_checks_total",
            "failures": "ray_neuron_online_validation_failures_total",
            "errors": "ray_neuron_online_validation_max_abs_error_count",
        }
        deadline = time.monotonic() + 30
        while True:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            got = {key: [v for _, v in samples(text, name, **ours)] for key, name in names.items()}
            if got["checks"] and got["errors"]:
                break
            assert time.monotonic() < deadline, f"no online validation series yet: {got}"
            time.sleep(1.0)
        assert got["checks"] == [1.0] and got["errors"] == [1.0]
        assert got["failures"] in ([], [0.0])  # a counter appears once it has counted
        # The one error observed lies within float32's bound (1e-3 + 1e-4 x max|logit|; the
        # tiny model's logits stay under ~10).
        name = "ray_neuron_online_validation_max_abs_error_bucket"
        buckets = {labels["le"]: v for labels, v in samples(text, name, **ours)}
        assert buckets["0.001"] == 1.0, buckets
        handle = serve.get_deployment_handle("LLMServer", app_name=APP)
        stats = handle.stats.remote().result(timeout_s=30)
        assert not busy_engines([stats])
        assert stats["online_validation"] == {
            "checks": 1,
            "failures": 0,
            "dropped": 0,
            "pending": 0,
        }
    finally:
        serve.delete(APP)
