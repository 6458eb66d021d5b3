"""Sampling in fixed shapes: every row runs every stage, with settings that make a stage a
no-op where the row does not ask for it, so the graph has no branch on the batch's values.

The stages and their order are the eager sampler's (sampler.py), so the values are the same:
penalties, the additive bias (logit_bias, allowed and banned tokens as -inf), temperature,
top-k/top-p, min-p, then the exponential race against noise drawn on the host from each
request's own generator (seeded requests stay reproducible and equal the eager path).
A row with top_k 0 and top_p 1 keeps every logit through the sort and scatter; min_p 0 keeps
every probability; penalties of 0 (1 for repetition) subtract zero and divide by one.

``max_top_k`` (Neuron) replaces the full-vocabulary sort with the best ``max_top_k`` tokens:
rows then keep at most that many candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from neuron_runtime.sampler import (
    SamplingBatch,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    exponential_noise,
    token_counts,
)
from neuron_runtime.scheduler import ScheduledSeq
from neuron_runtime.structured_output.bitmask import bitmask_bias


class SamplerKind(IntEnum):
    """Which graph a batch needs; fewer inputs for the common cases."""

    GREEDY = 0  # every row greedy: argmax of logits + bias
    RANDOM = 1  # some row samples
    PENALIZED = 2  # some row samples or is greedy with penalties


@dataclass
class StaticSamplingInputs:
    """Sampling settings by row; a padding row is greedy and its settings are no-ops."""

    kind: SamplerKind
    bias: torch.Tensor  # [S, V] float: 0, a logit_bias value, or -inf
    temperature: torch.Tensor | None = None  # [S]; 0 = greedy
    top_k: torch.Tensor | None = None  # [S] long; 0 = off
    top_p: torch.Tensor | None = None  # [S]
    min_p: torch.Tensor | None = None  # [S]
    noise: torch.Tensor | None = None  # [S, V] Exp(1) draws
    prompt_counts: torch.Tensor | None = None  # [S, V]
    output_counts: torch.Tensor | None = None  # [S, V]
    presence: torch.Tensor | None = None  # [S]
    frequency: torch.Tensor | None = None  # [S]
    repetition: torch.Tensor | None = None  # [S]


def greedy_tokens(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """[S, V] -> [S] long."""
    return (logits + bias).argmax(dim=-1)


def random_tokens(
    logits: torch.Tensor,
    bias: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    noise: torch.Tensor,
    max_top_k: int | None = None,
) -> torch.Tensor:
    logits = logits + bias
    greedy = logits.argmax(dim=-1)
    scaled = logits / torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
    if max_top_k is None:
        probs = apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)
        sampled = (apply_min_p(probs, min_p) / noise).argmax(dim=-1)
    else:
        # Candidates: the best max_top_k tokens, already sorted; top-k/top-p among them.
        values, ids = scaled.topk(max_top_k, dim=-1)
        capped = torch.where((top_k > 0) & (top_k < max_top_k), top_k, max_top_k)
        probs = apply_top_k_top_p(values, capped, top_p).softmax(dim=-1)
        probs = apply_min_p(probs, min_p)
        pick = (probs / noise.gather(1, ids)).argmax(dim=-1, keepdim=True)
        sampled = ids.gather(1, pick).squeeze(1)
    return torch.where(temperature > 0, sampled, greedy)


def penalized_tokens(
    logits: torch.Tensor,
    bias: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    noise: torch.Tensor,
    prompt_counts: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
    max_top_k: int | None = None,
) -> torch.Tensor:
    logits = apply_penalties(logits, prompt_counts, output_counts, presence, frequency, repetition)
    return random_tokens(logits, bias, temperature, top_k, top_p, min_p, noise, max_top_k)


def sampling_inputs(
    seqs: list[ScheduledSeq], batch: SamplingBatch, vocab: int, noise_device: torch.device
) -> StaticSamplingInputs:
    """The host side of a static sampling step: one row per sampled slice, unpadded, built
    on the CPU (``batch`` too) except the noise, drawn where the generators live.

    Draws the noise from each row's generator exactly as the eager sampler does (nothing when
    every row is greedy), so seeded rows take the same tokens on both paths.
    """
    n = len(seqs)
    device = torch.device("cpu")
    bias = torch.zeros(n, vocab, device=device)
    for row, seq in enumerate(seqs):
        for token, value in (seq.params.logit_bias or {}).items():
            bias[row, token] += value
        if seq.params.allowed_token_ids:
            allowed = torch.zeros(vocab, dtype=torch.bool, device=device)
            allowed[torch.tensor(seq.params.allowed_token_ids, device=device)] = True
            bias[row].masked_fill_(~allowed, float("-inf"))
        if seq.grammar_bitmask is not None:
            mask = seq.grammar_bitmask.get().to(device).unsqueeze(0)
            bias[row] += bitmask_bias(mask, vocab, bias.dtype)[0]
        if seq.banned_token_ids:
            bias[row, seq.banned_token_ids] = float("-inf")
    penalized = any(s.params.has_penalties for s in seqs)
    if not penalized and batch.all_greedy:
        return StaticSamplingInputs(SamplerKind.GREEDY, bias)
    if batch.all_greedy:
        noise = torch.ones(n, vocab, device=device)
    else:
        noise = exponential_noise(torch.Size((n, vocab)), batch.generators, noise_device)
    inputs = StaticSamplingInputs(
        SamplerKind.PENALIZED if penalized else SamplerKind.RANDOM,
        bias,
        temperature=batch.temperature,
        top_k=batch.top_k,
        top_p=batch.top_p,
        min_p=batch.min_p,
        noise=noise,
    )
    if penalized:
        inputs.prompt_counts = token_counts([s.prompt_token_ids for s in seqs], vocab, device)
        inputs.output_counts = token_counts([s.output_token_ids for s in seqs], vocab, device)
        params = [s.params for s in seqs]
        inputs.presence = torch.tensor([p.presence_penalty for p in params], device=device)
        inputs.frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
        inputs.repetition = torch.tensor([p.repetition_penalty for p in params], device=device)
    return inputs


# Field -> the value of a padding row (a no-op setting); bias, temperature and counts are 0.
PADDING = {"top_p": 1.0, "noise": 1.0, "repetition": 1.0}
ROW_FIELDS = (
    "bias",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "noise",
    "prompt_counts",
    "output_counts",
    "presence",
    "frequency",
    "repetition",
)


def select_rows(
    inputs: StaticSamplingInputs, rows: list[int | None], device: torch.device
) -> StaticSamplingInputs:
    """A bucket's inputs: row i takes ``inputs`` row ``rows[i]``, or padding where None; on
    ``device``."""
    out = StaticSamplingInputs(kind=inputs.kind, bias=inputs.bias)
    for name in ROW_FIELDS:
        value = getattr(inputs, name)
        if value is None:
            continue
        value = value.to("cpu")
        picked = value.new_full((len(rows), *value.shape[1:]), PADDING.get(name, 0))
        real = [i for i, r in enumerate(rows) if r is not None]
        if real:
            picked[real] = value[[rows[i] for i in real]]
        setattr(out, name, picked.to(device))
    return out


def sampler_args(inputs: StaticSamplingInputs) -> list[torch.Tensor]:
    """The graph arguments of ``inputs.kind``'s sampler, after the logits."""
    names: tuple[str, ...] = ROW_FIELDS[:1] if inputs.kind == SamplerKind.GREEDY else ROW_FIELDS[:6]
    if inputs.kind == SamplerKind.PENALIZED:
        names = ROW_FIELDS
    args = [getattr(inputs, name) for name in names]
    assert all(a is not None for a in args)
    return args
