"""The acceptance rule of speculative decoding, as pure tensor functions.

Every proposer here drafts deterministically (n-gram lookup, a draft's argmax), so the draft
distribution q at position i is one-hot on the draft token d_i, and the rule of Leviathan et
al. / Chen et al. reads:
    accept d_i with probability min(1, p_i(d_i) / q_i(d_i)) = p_i(d_i);
    at the first rejection, sample from norm(max(p_i - q_i, 0)) = p_i with d_i removed;
    when all k drafts are accepted, sample one more token from p_{k+1}.
Each emitted token is then distributed exactly as the target's own sample at that position.
Greedy requests accept while d_i equals the target's argmax and emit the argmax where they stop.

Under a grammar, p_i is the target's distribution masked by the grammar after the output plus
d_1 .. d_{i-1} (its own bitmask row; decoder.py), and drafts are cut before the first token the
grammar refuses, so every d_i is allowed where it stands; the rule then holds as written (a
draft with p_i(d_i) = 0, e.g. cut off by top-k, is always rejected).
"""

from __future__ import annotations

import torch

from neuron_runtime.sampler import SamplingBatch, apply_min_p, apply_top_k_top_p


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution the sampler draws from: temperature, top-k/top-p, min-p applied.

    logits: [R, V] processed logits (penalties, biases, masks done); batch: per-row settings,
    temperature > 0 on every row. Returns [R, V] probabilities.
    """
    logits = logits / batch.temperature.unsqueeze(1)
    if bool((batch.top_k > 0).any()) or bool((batch.top_p < 1).any()):
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    probs = logits.softmax(dim=-1)
    if bool((batch.min_p > 0).any()):
        probs = apply_min_p(probs, batch.min_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def accept_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    """Tokens a greedy request emits: the drafts up to the first that differs from the
    target's argmax, then the argmax at that position (or after the last draft).

    target_argmax: k + 1 tokens (the target's choice after each prefix); draft: k tokens.
    """
    out = []
    for i, token in enumerate(draft):
        if token != target_argmax[i]:
            break
        out.append(token)
    out.append(target_argmax[len(out)])
    return out


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` [V] by the exponential race (the sampler's own method)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return int((probs / noise).argmax())


def rejection_sample(
    probs: torch.Tensor, draft: list[int], generator: torch.Generator | None
) -> list[int]:
    """Tokens a sampling request emits (1 to k + 1): accepted drafts, then one token drawn
    from the residual distribution at the first rejection, or from p_{k+1}.

    probs: [k + 1, V] target probabilities at each verified position; draft: k tokens.
    ``generator``: the request's seeded generator (None: torch's default). A step draws k
    uniforms and one vocabulary-sized noise row whatever is accepted, so a seeded request's
    draws do not depend on the outcome of earlier steps' acceptances.
    """
    k = len(draft)
    device = probs.device
    uniform = torch.rand(k, generator=generator, device=device)
    draft_t = torch.tensor(draft, dtype=torch.long, device=device)
    p_draft = probs[:k].gather(1, draft_t.unsqueeze(1)).squeeze(1)  # [k]
    rejected = (uniform >= p_draft).nonzero()
    num_accepted = int(rejected[0]) if len(rejected) else k
    last = probs[num_accepted]
    if num_accepted < k:
        last = last.clone()
        last[draft[num_accepted]] = 0.0
        # All of p's mass sat on the rejected draft only if p(d) = 1, which never rejects.
        last = last / last.sum()
    return draft[:num_accepted] + [_draw(last, generator)]
