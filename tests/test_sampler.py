"""Sampler tensor functions against straightforward per-row reference implementations."""

from __future__ import annotations

import math

import pytest
import torch

from neuron_runtime.sampler import SamplingBatch, apply_min_p, apply_top_k_top_p, sample

V = 40


def ref_keep_top_k_top_p(row: list[float], top_k: int, top_p: float) -> set[int]:
    """Indices kept by top-k then top-p, the slow way (float64, explicit sort)."""
    order = sorted(range(len(row)), key=lambda i: row[i], reverse=True)
    if top_k > 0:
        order = order[:top_k]
    top = row[order[0]]
    weights = [math.exp(row[i] - top) for i in order]
    total = sum(weights)
    kept, mass = [], 0.0
    for i, w in zip(order, weights, strict=True):
        if top_p < 1.0 and kept and mass >= top_p:
            break
        kept.append(i)
        mass += w / total
    return set(kept)


def ref_softmax(row: list[float]) -> list[float]:
    top = max(row)
    weights = [math.exp(x - top) for x in row]
    total = sum(weights)
    return [w / total for w in weights]


def make_batch(
    n: int,
    temperature: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    top_p: float | list[float] = 1.0,
    min_p: float | list[float] = 0.0,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingBatch:
    def col(value, dtype):
        values = value if isinstance(value, list) else [value] * n
        return torch.tensor(values, dtype=dtype)

    return SamplingBatch(
        temperature=col(temperature, torch.float32),
        top_k=col(top_k, torch.long),
        top_p=col(top_p, torch.float32),
        min_p=col(min_p, torch.float32),
        generators=generators if generators is not None else [None] * n,
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


SETTINGS = [(0, 1.0), (1, 1.0), (5, 1.0), (V, 1.0), (100, 1.0), (0, 0.5), (0, 0.9), (0, 0.01)]
SETTINGS += [(7, 0.8), (3, 0.3), (20, 0.95)]


def test_top_k_top_p_matches_reference():
    gen = seeded(0)
    logits = torch.randn(len(SETTINGS), V, generator=gen)
    top_k = torch.tensor([k for k, _ in SETTINGS])
    top_p = torch.tensor([p for _, p in SETTINGS])
    masked = apply_top_k_top_p(logits, top_k, top_p)
    for row, (k, p) in enumerate(SETTINGS):
        kept = {i for i in range(V) if masked[row, i] != float("-inf")}
        expected = ref_keep_top_k_top_p(logits[row].double().tolist(), k, p)
        assert kept == expected, (k, p)
        for i in kept:
            assert masked[row, i] == logits[row, i]


def test_top_k_top_p_reference_is_not_trivial():
    # Guards the test above: the settings must actually keep different amounts.
    gen = seeded(0)
    logits = torch.randn(len(SETTINGS), V, generator=gen)
    sizes = {
        len(ref_keep_top_k_top_p(logits[i].tolist(), k, p)) for i, (k, p) in enumerate(SETTINGS)
    }
    assert sizes == {1, 4, 5, 10, 18, 26, 40}


def test_top_p_one_keeps_every_token_even_when_one_dominates():
    # Regression: the fp32 cumulative sum reaches 1.0 after a dominant token, which used to
    # drop the whole tail of rows that had top-p off whenever another row turned it on.
    logits = torch.tensor([[30.0, 0.0, 0.0, -5.0, -5.0], [30.0, 0.0, 0.0, -5.0, -5.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([0, 0]), torch.tensor([1.0, 0.5]))
    assert torch.equal(masked[0], logits[0])
    assert masked[1].tolist() == [30.0] + [float("-inf")] * 4


def test_top_k_one_keeps_only_the_max_and_top_k_above_vocab_keeps_all():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    one = apply_top_k_top_p(logits, torch.tensor([1]), torch.tensor([1.0]))
    assert one.tolist() == [[float("-inf"), 2.0, float("-inf"), float("-inf")]]
    big = apply_top_k_top_p(logits, torch.tensor([10]), torch.tensor([1.0]))
    assert torch.equal(big, logits)


def test_min_p_matches_reference():
    gen = seeded(1)
    probs = torch.randn(4, V, generator=gen).mul(2).softmax(dim=-1)
    min_p = torch.tensor([0.0, 0.05, 0.3, 1.0])
    out = apply_min_p(probs, min_p)
    for row in range(4):
        top = max(probs[row].tolist())
        for i, p in enumerate(probs[row].tolist()):
            expected = p if p >= min_p[row].item() * top else 0.0
            assert out[row, i].item() == pytest.approx(expected, abs=0)
    assert (out[0] > 0).sum() == V
    assert 1 < (out[1] > 0).sum() < V
    assert (out[3] > 0).sum() == 1


def test_greedy_rows_are_argmax():
    gen = seeded(2)
    logits = torch.randn(6, V, generator=gen)
    expected = [max(range(V), key=lambda i, r=r: logits[r, i].item()) for r in range(6)]
    assert sample(logits, make_batch(6, temperature=0.0)).tolist() == expected
    # Greedy rows stay argmax in a batch where other rows sample.
    mixed = make_batch(6, temperature=[0.0, 1.0, 0.0, 2.0, 0.0, 0.5], top_k=[0, 3, 0, 0, 0, 0])
    got = sample(logits, mixed)
    assert [got[i].item() for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]


@pytest.mark.parametrize("setting", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_settings_equivalent_to_greedy(setting):
    gen = seeded(3)
    logits = torch.randn(64, V, generator=gen)
    batch = make_batch(64, temperature=1.0, **setting)
    torch.manual_seed(0)
    assert torch.equal(sample(logits, batch), logits.argmax(dim=-1))


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


# 99.9th percentile of chi-square with 5 and 2 degrees of freedom.
CHI2_999 = {5: 20.52, 2: 13.82}


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 0.3])
    n = 60_000
    torch.manual_seed(1234)
    tokens = sample(logits.expand(n, -1).clone(), make_batch(n, temperature=temperature))
    counts = torch.bincount(tokens, minlength=6).tolist()
    expected = ref_softmax([x / temperature for x in logits.tolist()])
    assert chi_square(counts, expected) < CHI2_999[5]


def test_empirical_distribution_with_top_k_renormalizes():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 0.3])
    n = 60_000
    torch.manual_seed(99)
    tokens = sample(logits.expand(n, -1).clone(), make_batch(n, top_k=3))
    counts = torch.bincount(tokens, minlength=6).tolist()
    kept = [0, 5, 1]  # the three largest logits
    assert sum(counts[i] for i in kept) == n
    expected = ref_softmax([logits[i].item() for i in kept])
    assert chi_square([counts[i] for i in kept], expected) < CHI2_999[2]


def test_distribution_test_can_fail():
    # The same statistic flags samples drawn at the wrong temperature.
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 0.3])
    n = 60_000
    torch.manual_seed(1234)
    tokens = sample(logits.expand(n, -1).clone(), make_batch(n, temperature=1.3))
    counts = torch.bincount(tokens, minlength=6).tolist()
    assert chi_square(counts, ref_softmax(logits.tolist())) > CHI2_999[5]


def test_seeded_row_is_independent_of_the_batch():
    gen = seeded(4)
    row = torch.randn(V, generator=gen) * 0.5  # flat enough that seeds pick different tokens
    others = torch.randn(3, V, generator=gen) * 3
    alone_tokens = []
    for seed in range(30):
        alone = sample(row.unsqueeze(0), make_batch(1, generators=[seeded(seed)])).item()
        batch = make_batch(
            4,
            temperature=[0.7, 1.0, 0.0, 1.5],
            top_k=[5, 0, 0, 0],
            top_p=[1.0, 1.0, 1.0, 0.6],
            min_p=[0.0, 0.0, 0.0, 0.1],
            generators=[seeded(1000 + seed), seeded(seed), None, None],
        )
        logits = torch.cat([others[:1], row.unsqueeze(0), others[1:]])
        assert sample(logits, batch)[1].item() == alone
        alone_tokens.append(alone)
    assert len(set(alone_tokens)) > 5


def test_same_seed_same_sequence():
    gen = seeded(5)
    steps = torch.randn(20, 1, V, generator=gen)
    runs = []
    for _ in range(2):
        g = seeded(77)
        runs.append([sample(s, make_batch(1, generators=[g])).item() for s in steps])
    assert runs[0] == runs[1]
    other = seeded(78)
    assert [sample(s, make_batch(1, generators=[other])).item() for s in steps] != runs[0]


def test_min_p_never_samples_removed_tokens():
    logits = torch.tensor([2.0, 1.9, 0.0, -1.0, -3.0])
    probs = ref_softmax(logits.tolist())
    allowed = {i for i, p in enumerate(probs) if p >= 0.2 * max(probs)}
    assert allowed == {0, 1}
    n = 5_000
    torch.manual_seed(7)
    tokens = sample(logits.expand(n, -1).clone(), make_batch(n, min_p=0.2))
    assert set(tokens.tolist()) == allowed


def test_all_greedy():
    assert make_batch(2, temperature=0.0).all_greedy
    assert not make_batch(2, temperature=[0.0, 0.1]).all_greedy
