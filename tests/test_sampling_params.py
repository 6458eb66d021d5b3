"""SamplingParams validation and helpers."""

from __future__ import annotations

import math

import pytest

from neuron_runtime.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"n": 0}, "n"),
        ({"n": -1}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": "7"}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
    ],
)
def test_invalid_values_raise_naming_the_field(changes, field):
    # The message starts with the field's name (and not a longer name sharing its prefix).
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**changes)


@pytest.mark.parametrize(
    "changes",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"max_tokens": None, "min_tokens": 100},
        {"max_tokens": 1, "min_tokens": 1},
        {"stop": ["\n"], "stop_token_ids": [0, 5]},
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
    ],
)
def test_boundary_values_are_accepted(changes):
    params = SamplingParams(**changes)
    for name, value in changes.items():
        assert getattr(params, name) == value


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)


def test_greedy():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-5).greedy


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_child_offsets_the_seed_and_has_n_1():
    parent = SamplingParams(n=3, seed=10, temperature=0.7, top_k=5)
    children = [parent.child(i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 for c in children)
    assert all(c.temperature == 0.7 and c.top_k == 5 for c in children)
    assert parent.n == 3 and parent.seed == 10
    assert SamplingParams(n=2).child(1).seed is None


def test_replace_validates():
    params = SamplingParams(max_tokens=8)
    assert params.replace(max_tokens=4).max_tokens == 4
    assert params.max_tokens == 8
    with pytest.raises(ValueError, match="top_p"):
        params.replace(top_p=2.0)


def test_a_top_k_past_any_vocabulary_is_off():
    """It keeps every token, as 0 does, and must not reach int64 tensors as is."""
    assert SamplingParams(top_k=10**30).top_k == 0
    assert SamplingParams(top_k=2**31 - 1).top_k == 2**31 - 1
