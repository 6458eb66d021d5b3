"""Token sampling as pure tensor functions, vectorized over the batch.

Random rows draw with the "exponential race": ``argmax(p / q)`` with ``q ~ Exp(1)`` picks token
``i`` with probability ``p_i``. Each seeded request draws its ``q`` from its own generator, over
the full vocabulary, so its tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step, as tensors."""

    temperature: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor  # [B] long; 0 = off
    top_p: torch.Tensor  # [B] float; 1 = off
    min_p: torch.Tensor  # [B] float; 0 = off
    generators: list[torch.Generator | None]  # per row; None = the shared generator

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())


def token_counts(token_ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row's list: [B, V] float."""
    counts = torch.zeros(len(token_ids), vocab, device=device)
    lengths = torch.tensor([len(ids) for ids in token_ids], device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_ids), device=device), lengths)
    cols = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long, device=device)
    counts.index_put_((rows, cols), torch.ones_like(cols, dtype=counts.dtype), accumulate=True)
    return counts


def apply_penalties(
    logits: torch.Tensor,
    prompt_counts: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties. logits, prompt_counts, output_counts: [B, V]; the penalties: [B].

    repetition (on prompt and output tokens): positive logits / r, negative ones * r;
    frequency: minus f per occurrence in the output; presence: minus p once if in the output.
    """
    seen = (prompt_counts > 0) | (output_counts > 0)
    factor = torch.where(seen, repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> torch.Tensor:
    """Adds each row's {token id: bias} to its logits. logits: [B, V]."""
    rows = [row for row, bias in enumerate(biases) for _ in (bias or {})]
    cols = [token for bias in biases for token in (bias or {})]
    values = [value for bias in biases for value in (bias or {}).values()]
    index = (
        torch.tensor(rows, device=logits.device),
        torch.tensor(cols, dtype=torch.long, device=logits.device),
    )
    values_t = torch.tensor(values, dtype=logits.dtype, device=logits.device)
    return logits.index_put(index, values_t, accumulate=True)


def apply_allowed_tokens(logits: torch.Tensor, allowed: list[list[int] | None]) -> torch.Tensor:
    """Masks (to -inf) every token outside a row's allowed list; rows with None keep all.

    logits: [B, V].
    """
    keep = torch.zeros_like(logits, dtype=torch.bool)
    for row, ids in enumerate(allowed):
        if ids is None:
            keep[row] = True
        else:
            keep[row, torch.tensor(ids, dtype=torch.long, device=logits.device)] = True
    return logits.masked_fill(~keep, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-k and top-p nucleus. logits: [B, V]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the top one stays).
    # Rows with top_p = 1 are skipped: the fp32 cumsum reaches 1.0 before the tail does.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zeroes tokens whose probability is below ``min_p`` times the row's top probability."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def exponential_noise(
    shape: torch.Size, generators: list[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    noise = torch.empty(shape, device=device).exponential_()
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    # A zero draw would turn p / q into inf or NaN; the floor changes nothing measurable.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def skip_draws(seed: int, num_tokens: int, vocab: int, device: torch.device) -> torch.Generator:
    """A request's seeded generator as it is after sampling ``num_tokens`` tokens.

    ``exponential_noise`` draws one [vocab] row from it per sampled token; the same draws are
    made here (their count, not their values, is what moves the state on), so a request
    resumed elsewhere after those tokens samples on as it would have. Speculative decoding's
    rejection sampler draws a varying amount per token: there the count is not known.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    row = torch.empty(vocab, device=device)
    for _ in range(num_tokens):
        row.exponential_(generator=generator)
    return generator


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Picks one token per row. logits: [B, V] fp32 -> [B] long.

    ``argmax`` is a backend's faster row argmax of ``logits`` (the same result as torch's).
    """
    greedy = logits.argmax(dim=-1) if argmax is None else argmax(logits)
    if batch.all_greedy:
        return greedy
    temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
    logits = logits / temperature.unsqueeze(1)
    if bool((batch.top_k > 0).any()) or bool((batch.top_p < 1).any()):
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    probs = logits.softmax(dim=-1)
    if bool((batch.min_p > 0).any()):
        probs = apply_min_p(probs, batch.min_p)
    noise = exponential_noise(probs.shape, batch.generators, probs.device)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(batch.temperature > 0, sampled, greedy)


def top_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the model's distribution (before sampling settings).

    Returns (sampled [B], top ids [B, num_top], top logprobs [B, num_top]).
    """
    logprobs = logits.log_softmax(dim=-1)
    sampled = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return sampled, top_ids, top_values
