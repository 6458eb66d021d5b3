"""The static runner on torch-xla's CPU device (``make test-xla``: its own venv with
torch==2.9.0 and torch-xla==2.9.0, ``PJRT_DEVICE=CPU``): the XLA lowering torch-neuronx
consumes. Skipped where torch_xla is not installed (the main venv, CI)."""

from __future__ import annotations

import os

import pytest

torch_xla = pytest.importorskip("torch_xla")
os.environ.setdefault("PJRT_DEVICE", "CPU")

from test_static_graphs import ENGINE, generate, prompts  # noqa: E402

from neuron_runtime import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.xla

XLA = dict(
    device="xla",
    compile_scope="step",
    seq_buckets=[2, 8],
    token_buckets=[16, 32],
    context_buckets=[8, 32],
    on_recompile="error",
)


@pytest.fixture(scope="module")
def eager(tiny_llama_path):
    return LLM(model=str(tiny_llama_path), **ENGINE)


@pytest.mark.parametrize("graph_mode", ["lazy", "openxla"])
def test_xla_matches_eager_and_compiles_nothing_after_warm_up(eager, tiny_llama_path, graph_mode):
    static = LLM(model=str(tiny_llama_path), **ENGINE, **XLA, graph_mode=graph_mode)
    runner = static.engine.runner.static
    assert runner is not None and static.engine.runner.device.type == "xla"
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert generate(static, greedy) == generate(eager, greedy)
    seeded = [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=i, ignore_eos=True)
        for i in range(len(prompts()))
    ]
    assert generate(static, seeded) == generate(eager, seeded)
    for batch in (1, 3, 8):
        static.generate([{"prompt_token_ids": p} for p in prompts()[:batch]], greedy)
    assert runner.num_compiles_after_warm_up == 0
    assert static.engine.scheduler.num_preemptions > 0
