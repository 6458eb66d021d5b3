"""Penalties and logit_bias: the tensor functions against per-row reference loops."""

from __future__ import annotations

import pytest
import torch

from neuron_runtime.sampler import apply_logit_bias, apply_penalties, token_counts
from neuron_runtime.sampling_params import SamplingParams

V = 30


def ref_penalize(
    row: list[float],
    prompt: list[int],
    output: list[int],
    presence: float,
    frequency: float,
    repetition: float,
) -> list[float]:
    out = list(row)
    for token in set(prompt) | set(output):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return out


def test_token_counts_counts_repeats_and_handles_empty_rows():
    counts = token_counts([[1, 1, 4], [], [29]], V, torch.device("cpu"))
    assert counts.shape == (3, V)
    assert counts[0, 1] == 2 and counts[0, 4] == 1 and counts[0].sum() == 3
    assert counts[1].sum() == 0
    assert counts[2, 29] == 1


def test_apply_penalties_matches_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=gen) * 3
    prompts = [[1, 2, 3], [5, 5], [], [7, 8, 9, 10]]
    outputs = [[3, 3, 4], [], [0, 0, 0, 11], [7, 20]]
    presence = [0.5, -1.0, 2.0, 0.0]
    frequency = [0.25, 0.0, -0.5, 1.5]
    repetition = [1.3, 0.7, 1.0, 2.0]
    got = apply_penalties(
        logits,
        token_counts(prompts, V, logits.device),
        token_counts(outputs, V, logits.device),
        torch.tensor(presence),
        torch.tensor(frequency),
        torch.tensor(repetition),
    )
    for b in range(4):
        want = ref_penalize(
            logits[b].tolist(), prompts[b], outputs[b], presence[b], frequency[b], repetition[b]
        )
        assert got[b].tolist() == pytest.approx(want, abs=1e-5)


def test_neutral_penalties_change_nothing():
    logits = torch.randn(2, V)
    counts = token_counts([[1, 2], [3]], V, logits.device)
    zeros = torch.zeros(2)
    got = apply_penalties(logits, counts, counts, zeros, zeros, torch.ones(2))
    assert torch.equal(got, logits)


def test_apply_logit_bias_adds_per_row():
    logits = torch.zeros(3, V)
    got = apply_logit_bias(logits, [{1: 5.0, 2: -100.0}, None, {29: 0.5}])
    want = torch.zeros(3, V)
    want[0, 1], want[0, 2], want[2, 29] = 5.0, -100.0, 0.5
    assert torch.equal(got, want)
    assert torch.equal(logits, torch.zeros(3, V))  # not modified in place


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("presence_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("logit_bias", {1: 101.0}),
        ("logit_bias", {-1: 1.0}),
    ],
)
def test_sampling_params_rejects_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_has_penalties():
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert not SamplingParams(logit_bias={1: 1.0}).has_penalties


def test_engine_applies_logit_bias_and_penalties(tiny_llama_path):
    from neuron_runtime import LLM

    llm = LLM(model=str(tiny_llama_path), max_model_len=128, num_kv_blocks=32)
    prompt = [1, 100, 200, 300]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (plain,) = llm.generate(prompt, greedy)
    (forced,) = llm.generate(prompt, greedy.replace(logit_bias={1234: 100.0}))
    assert forced.outputs[0].token_ids == [1234] * 8
    # Each occurrence costs 2 + 2 (presence once): the bias of 10 soon stops winning.
    (varied,) = llm.generate(
        prompt, greedy.replace(logit_bias={1234: 10.0}, frequency_penalty=2.0, presence_penalty=2.0)
    )
    assert 1 <= varied.outputs[0].token_ids.count(1234) < 8
    assert plain.outputs[0].token_ids != forced.outputs[0].token_ids
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(prompt, greedy.replace(logit_bias={10**6: 1.0}))
