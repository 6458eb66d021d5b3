"""Logit and activation error metrics, and the tolerances they are held to per dtype.

Every comparison is ours against a reference (transformers on the same weights), row by row:
one row per token position, ``[positions, vocab]`` for logits, ``[positions, hidden]`` for
hidden states.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

# The smallest reference scale a relative error divides by (a row of zeros stays finite).
_TINY = 1e-12


@dataclass(frozen=True)
class Tolerance:
    """What ``validate`` accepts at one token position.

    ``atol + rtol * max|reference logit|`` bounds the largest absolute logit error; ``kl`` the
    KL divergence of our next-token distribution from the reference's; ``topk`` the share of
    the reference's top-k tokens found in ours (a token whose reference logit is within twice
    the allowed error of the k-th largest counts as found: such near ties may swap).
    ``module_rtol`` bounds a module output's largest error relative to the largest reference
    value (the accuracy debugger).
    """

    atol: float
    rtol: float
    kl: float
    topk: float
    module_rtol: float

    def __post_init__(self) -> None:
        for name in ("atol", "rtol", "kl", "module_rtol"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"tolerance {name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.topk <= 1:
            raise ValueError(f"tolerance topk must be in [0, 1], got {self.topk}")


# Keyed by the dtype the reference runs in (an engine with bf16 linear layers, --engine-dtype,
# is held to the bfloat16 bounds whatever the reference).
# float32: both sides differ only in summation order (paged and chunked attention, fused
# kernels): 1e-5 measured on the tiny models, 1.3e-4 on SmolLM2's 30 layers (logits ~30).
# float16/bfloat16 references round every activation to 11/8 mantissa bits; the bounds are
# about twice what that rounding gave on SmolLM2 (docs/accuracy.md): max abs 0.15 / 1.8,
# KL 1.4e-4 / 1.3e-2, module error 2.7e-2 / 0.2. Such a reference cannot see an error smaller
# than its own rounding; deeper models round more (pass a Tolerance of your own).
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-3, rtol=1e-4, kl=1e-5, topk=1.0, module_rtol=1e-3),
    "float16": Tolerance(atol=0.1, rtol=1e-2, kl=1e-3, topk=0.8, module_rtol=6e-2),
    "bfloat16": Tolerance(atol=0.5, rtol=0.15, kl=5e-2, topk=0.6, module_rtol=0.4),
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class PositionErrors:
    """One token position's errors (see ``Tolerance`` for what each bounds)."""

    position: int
    max_abs: float
    max_rel: float  # max_abs / max|reference|
    kl: float | None  # None for hidden states (no distribution)
    topk: float | None
    top1_match: bool | None
    passed: bool

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def topk_agreement(
    ours: torch.Tensor, ref: torch.Tensor, k: int, slack: torch.Tensor
) -> torch.Tensor:
    """Per row, the share of the reference's top-k tokens in our top-k: [rows].

    A reference top-k token missing from ours still counts when its reference logit is within
    ``slack`` [rows] of the reference's k-th largest: a near tie may order either way.
    """
    k = min(k, ref.shape[-1])
    ref_values, ref_ids = ref.topk(k, dim=-1)  # [rows, k]
    our_ids = ours.topk(k, dim=-1).indices  # [rows, k]
    found = (ref_ids.unsqueeze(-1) == our_ids.unsqueeze(-2)).any(dim=-1)  # [rows, k]
    tied = (ref_values - ref_values[:, -1:]) <= slack.unsqueeze(-1)
    return (found | tied).float().mean(dim=-1)


def compare_logits(
    ours: torch.Tensor,  # [positions, vocab]
    ref: torch.Tensor,  # [positions, vocab]
    tol: Tolerance,
    k: int = 5,
) -> list[PositionErrors]:
    """Errors of every position of ``ours`` against ``ref`` and whether each passes ``tol``."""
    if ours.shape != ref.shape:
        raise ValueError(
            f"logits shapes differ: ours {tuple(ours.shape)}, reference {tuple(ref.shape)}"
        )
    ours, ref = ours.double(), ref.double()
    diff = (ours - ref).abs().amax(dim=-1)  # [P]
    scale = ref.abs().amax(dim=-1)  # [P]
    ref_logp = ref.log_softmax(dim=-1)
    kl = (ref_logp.exp() * (ref_logp - ours.log_softmax(dim=-1))).sum(dim=-1).clamp_min(0)
    bound = tol.atol + tol.rtol * scale  # [P]: the error allowed at each position
    agree = topk_agreement(ours, ref, k, 2 * bound)
    top1 = ours.argmax(dim=-1) == ref.argmax(dim=-1)
    ok = (diff <= bound) & (kl <= tol.kl) & (agree >= tol.topk)
    return [
        PositionErrors(
            position=i,
            max_abs=float(diff[i]),
            max_rel=float(diff[i] / scale[i].clamp_min(_TINY)),
            kl=float(kl[i]),
            topk=float(agree[i]),
            top1_match=bool(top1[i]),
            passed=bool(ok[i]),
        )
        for i in range(ref.shape[0])
    ]


def compare_hidden(
    ours: torch.Tensor,  # [positions, hidden]
    ref: torch.Tensor,  # [positions, hidden]
    tol: Tolerance,
) -> list[PositionErrors]:
    """Per-position errors of hidden states (encoder models), held to ``atol + rtol * scale``."""
    if ours.shape != ref.shape:
        raise ValueError(
            f"output shapes differ: ours {tuple(ours.shape)}, reference {tuple(ref.shape)}"
        )
    ours, ref = ours.double(), ref.double()
    diff = (ours - ref).abs().amax(dim=-1)
    scale = ref.abs().amax(dim=-1)
    ok = diff <= tol.atol + tol.rtol * scale
    return [
        PositionErrors(
            i,
            float(diff[i]),
            float(diff[i] / scale[i].clamp_min(_TINY)),
            None,
            None,
            None,
            bool(ok[i]),
        )
        for i in range(ref.shape[0])
    ]


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|ours - ref| / max|ref|`` over a whole tensor (one module output)."""
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(_TINY))
