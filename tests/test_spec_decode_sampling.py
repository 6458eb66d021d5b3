"""The rejection-sampling rule keeps the target's distribution: checked against a fresh
computation of that distribution on a tiny vocabulary, and end to end against the engine
without speculation over many seeds."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from neuron_runtime.llm import LLM
from neuron_runtime.sampler import SamplingBatch
from neuron_runtime.sampling_params import SamplingParams
from neuron_runtime.spec_decode.rejection import accept_greedy, rejection_sample, target_probs

# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def chi_square(observed: list[int], expected: list[float]) -> float:
    return sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)


def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]  # all accepted, then the bonus
    assert accept_greedy([5, 9, 7], [5, 6]) == [5, 9]  # stops at the first mismatch
    assert accept_greedy([4, 6, 7], [5, 6]) == [4]


def test_rejection_sampling_reproduces_the_target_distribution():
    """k = 2 drafts over a 6-token vocabulary; the first emitted token must follow p0, the
    second (given the first draft accepted) p1, whatever the drafts are."""
    logits = torch.tensor(
        [
            [2.0, 1.0, 0.5, 0.0, -1.0, 0.3],
            [0.0, 0.2, 1.5, -0.5, 1.0, 0.1],
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        ]
    )
    temperature = 0.9
    # A fresh computation of the distributions: softmax(logits / T).
    exp = torch.exp(logits / temperature)
    p = exp / exp.sum(dim=-1, keepdim=True)
    batch = SamplingBatch(
        temperature=torch.full((3,), temperature),
        top_k=torch.zeros(3, dtype=torch.long),
        top_p=torch.ones(3),
        min_p=torch.zeros(3),
        generators=[None] * 3,
    )
    probs = target_probs(logits, batch)
    assert torch.allclose(probs, p, atol=1e-6)
    draft = [1, 3]  # a fair guess, then an unlikely one
    gen = torch.Generator().manual_seed(1234)
    trials = 12000
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for _ in range(trials):
        tokens = rejection_sample(probs, draft, gen)
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            second[tokens[1]] += 1
    observed = [first[t] for t in range(6)]
    stat = chi_square(observed, [trials * float(q) for q in p[0]])
    assert stat < CHI2_CRITICAL[5], (observed, p[0])
    n = sum(second.values())
    observed2 = [second[t] for t in range(6)]
    stat2 = chi_square(observed2, [n * float(q) for q in p[1]])
    assert stat2 < CHI2_CRITICAL[5], (observed2, p[1])
    tv = 0.5 * sum(abs(o / trials - float(q)) for o, q in zip(observed, p[0], strict=True))
    assert tv < 0.02


def test_target_probs_with_top_k_and_min_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    batch = SamplingBatch(
        temperature=torch.tensor([0.5]),
        top_k=torch.tensor([3]),
        top_p=torch.ones(1),
        min_p=torch.tensor([0.05]),
        generators=[None],
    )
    # Fresh: softmax over the top 3 of logits / 0.5, then drop tokens under 0.05 * max.
    kept = torch.exp(torch.tensor([3.0, 2.0, 1.0]) / 0.5)
    kept = kept / kept.sum()
    kept = torch.where(kept < 0.05 * kept.max(), 0.0, kept)
    expected = torch.zeros(5)
    expected[:3] = kept / kept.sum()
    assert torch.allclose(target_probs(logits, batch)[0], expected, atol=1e-6)


ALLOWED = [11, 12, 13, 14]


@pytest.fixture(scope="module")
def sampled_runs(tiny_llama_path):
    """The token at output position 3 of many seeded requests, with and without n-gram
    speculation (the prompt repeats, so drafts are proposed and often rejected)."""
    prompt = ALLOWED * 6 + ALLOWED[:2]
    seeds = range(300)
    params = [
        SamplingParams(
            temperature=4.0, seed=s, max_tokens=4, ignore_eos=True, allowed_token_ids=ALLOWED
        )
        for s in seeds
    ]
    args = dict(model=str(tiny_llama_path), max_model_len=128, num_kv_blocks=256)
    runs = {}
    for name, spec in (
        ("plain", None),
        ("ngram", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}),
    ):
        llm = LLM(**args, speculative_config=spec)
        outputs = llm.generate([prompt] * len(params), params)
        runs[name] = ([o.outputs[0].token_ids for o in outputs], llm.engine.stats())
    return runs


def test_sampled_distribution_matches_no_speculation(sampled_runs):
    plain, _ = sampled_runs["plain"]
    spec, stats = sampled_runs["ngram"]
    assert 0 < stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens
    a = Counter(t[3] for t in plain)
    b = Counter(t[3] for t in spec)
    # Two-sample chi-square over the tokens either run produced.
    tokens = sorted(set(a) | set(b))
    stat = sum((a[t] - b[t]) ** 2 / (a[t] + b[t]) for t in tokens)
    assert len(tokens) >= 2
    assert stat < CHI2_CRITICAL[len(tokens) - 1], (a, b)


def test_seeded_sampling_with_speculation_is_reproducible(tiny_llama_path, sampled_runs):
    spec, _ = sampled_runs["ngram"]
    prompt = ALLOWED * 6 + ALLOWED[:2]
    llm = LLM(
        model=str(tiny_llama_path),
        max_model_len=128,
        num_kv_blocks=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
    )
    params = SamplingParams(
        temperature=4.0, seed=5, max_tokens=4, ignore_eos=True, allowed_token_ids=ALLOWED
    )
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == spec[5]
