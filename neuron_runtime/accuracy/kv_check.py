"""The KV check: a sequence's paged KV, rebuilt as contiguous tensors, against transformers'
``past_key_values`` for the same tokens.

Both hold keys after the rotary embedding (and any q/k norm) and values as projected, so they
compare directly. ``check_request_kv`` takes the KV of a real request: the engine runs it in
the prefill role, which keeps the prompt's blocks held after its first token, reads them
(``LLMEngine.read_kv``) and releases them.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from neuron_runtime.accuracy.metrics import Tolerance, relative_error

if TYPE_CHECKING:
    from neuron_runtime.accuracy.teacher import Reference
    from neuron_runtime.engine import LLMEngine


@dataclass(frozen=True)
class KVCheck:
    """The worst layer's KV error relative to the largest reference value of that tensor."""

    num_tokens: int
    max_abs: float
    max_rel: float
    worst_layer: int
    worst_tensor: str  # "keys" or "values"
    passed: bool

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def compare_kv(
    kv: np.ndarray,  # [2, layers, kv_heads, tokens, head_dim]: ours, contiguous
    past: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [kv_heads, kept, head_dim]
    tol: Tolerance,
) -> KVCheck:
    """Compares every layer's keys and values; a layer that kept fewer tokens (a sliding
    window) is compared on the tokens it kept, the last ones."""
    _, num_layers, _, num_tokens, _ = kv.shape
    if len(past) != num_layers:
        raise ValueError(f"the reference caches {len(past)} layers, ours {num_layers}")
    ours = torch.from_numpy(kv)
    worst = (-1.0, 0.0, 0, "keys")
    for layer, (keys, values) in enumerate(past):
        for index, (label, ref) in enumerate((("keys", keys), ("values", values))):
            kept = ref.shape[1]
            if kept > num_tokens or ref.shape[0] != ours.shape[2]:
                raise ValueError(
                    f"layer {layer} {label}: reference shape {tuple(ref.shape)} does not fit "
                    f"ours {tuple(ours.shape[2:])}"
                )
            got = ours[index, layer, :, num_tokens - kept :]
            rel = relative_error(got, ref)
            if rel > worst[0]:
                worst = (rel, float((got.double() - ref.double()).abs().max()), layer, label)
    rel, abs_err, layer, label = worst
    return KVCheck(num_tokens, abs_err, rel, layer, label, rel <= tol.module_rtol)


def check_request_kv(
    engine: LLMEngine, reference: Reference, prompt_token_ids: list[int], tol: Tolerance
) -> KVCheck:
    """Runs ``prompt_token_ids`` as a real request (prefill role: one token, KV held), reads
    its KV from the paged cache and compares it with the reference's; frees the blocks."""
    from neuron_runtime.accuracy.teacher import Sample
    from neuron_runtime.outputs import RequestOutputKind
    from neuron_runtime.sampling_params import SamplingParams

    request_id = f"kv-check-{uuid.uuid4().hex[:8]}"
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request(
        request_id,
        {"prompt_token_ids": prompt_token_ids},
        params,
        RequestOutputKind.FINAL_ONLY,
        export_kv=True,
    )
    handoff = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.kv_handoff is not None:
                handoff = output.kv_handoff
    if handoff is None:
        raise ValueError("the request ended without handing off its KV")
    try:
        payload = engine.read_kv(handoff)
    finally:
        engine.release_kv(handoff.handoff_id)
    n = len(prompt_token_ids)
    _, past = reference.logits_and_cache(Sample(request_id, prompt_token_ids, n))
    return compare_kv(payload.kv, past, tol)
