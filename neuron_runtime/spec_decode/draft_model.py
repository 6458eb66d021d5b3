"""Draft-model proposer: a smaller model with the same vocabulary, or the target's first
layers (self-speculation), drafting greedily over KV paged in the engine's own blocks.

The draft's KV lives at the same block ids and slots as the target's (one block table per
request, as in the picture in kv_cache.py), in cache tensors of its own; a self-speculative
draft uses the target's own first-layer caches, whose KV for every computed token is exactly
what the draft would have written. Drafting the k tokens after position T - 1 runs:

    catch-up:  the tokens the draft has no KV for yet, up to the last one (T - 1) -> d1
    k - 1 x:   d_i at position T - 1 + i -> d_{i+1}

so it writes slots up to T + k - 2, all inside the blocks the verify step needs (the
SpecDecoder allocates them first). After verification the draft's KV is valid up to
min(T + k - 1, num_computed_tokens); a preempted request starts over.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from neuron_runtime.config import EngineConfig, ModelConfig
from neuron_runtime.kv_transfer import DraftHidden
from neuron_runtime.loader import load_hf_config, load_model
from neuron_runtime.model_store import resolve_model
from neuron_runtime.models.llama import LlamaModel
from neuron_runtime.models.registry import complete_config, model_class
from neuron_runtime.request import Request
from neuron_runtime.scheduler import ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from neuron_runtime.model_runner import ModelRunner, ModelRunnerOutput, StepInputs


def first_layers(model: nn.Module, num_layers: int) -> nn.Module:
    """The decoder stack of a Llama-family ``model`` cut to its first ``num_layers`` layers
    (embedding and final norm kept), sharing every weight with it."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, LlamaModel):
        raise ValueError(
            f"self-speculation needs a Llama-family decoder, not {type(model).__name__}"
        )
    total = len(inner.layers)
    if not 1 <= num_layers < total:
        raise ValueError(
            f"speculative_config.num_draft_layers must be in [1, {total - 1}] for a "
            f"{total}-layer model, got {num_layers}"
        )
    view = copy.copy(inner)
    view._modules = dict(inner._modules)  # its own module table: the target keeps all layers
    view.layers = inner.layers[:num_layers]
    sliding = getattr(inner, "sliding", None)
    if isinstance(sliding, list):  # Gemma 3: per-layer window flags
        setattr(view, "sliding", sliding[:num_layers])  # noqa: B010 (a plain list attribute)
    return view


class DraftModelProposer:
    """Drafts greedily with a draft model (or the target's first layers)."""

    needs_slots = True

    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        spec = config.speculative
        assert spec is not None
        self.runner = runner
        self.block_size = config.cache.block_size
        self._fed_end: dict[str, int] = {}  # req_id -> draft KV written for positions below
        self._preemptions: dict[str, int] = {}
        self.head: Any  # computes the draft's logits
        if spec.self_speculative(config.model.name):
            assert spec.num_draft_layers is not None
            stack = first_layers(runner.model, spec.num_draft_layers)
            self.kv_caches = runner.kv_caches[: spec.num_draft_layers]
            self.shares_kv = True
            self.decoder: Any = stack
            self.head = runner.model
        else:
            assert spec.model is not None
            model, draft = load_draft(spec.model, config.model)
            self.decoder = self.head = runner.backend.prepare_model(model)
            shape = runner.kv_caches[0][0].shape  # [kvh, num_blocks, block_size, head_dim]
            draft_shape = (draft.num_kv_heads, shape[1], shape[2], draft.head_dim)
            self.kv_caches = [
                (
                    torch.zeros(draft_shape, dtype=runner.kv_dtype, device=runner.device),
                    torch.zeros(draft_shape, dtype=runner.kv_dtype, device=runner.device),
                )
                for _ in range(draft.num_layers)
            ]
            self.shares_kv = False

    def _start(self, request: Request) -> int:
        """The first position whose draft KV is missing."""
        if self.shares_kv:
            return request.num_computed_tokens
        fed = self._fed_end.get(request.req_id)
        if fed is None or self._preemptions[request.req_id] != request.num_preemptions:
            # A prefix-cache hit's blocks hold the draft KV of whoever computed them; only
            # the acceptance rate depends on it, never the output.
            return request.num_cached_tokens
        return min(fed, request.num_computed_tokens)

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        seqs = []
        for request in requests:
            start = self._start(request)
            seqs.append(_seq(request, request.all_token_ids[start:], start))
        drafts = {r.req_id: [t] for r, t in self._step(seqs).items()}
        for i in range(1, max(num_tokens)):
            seqs = [
                _seq(r, [drafts[r.req_id][-1]], r.num_tokens - 1 + i)
                for r, k in zip(requests, num_tokens, strict=True)
                if k > i
            ]
            for r, token in self._step(seqs).items():
                drafts[r.req_id].append(token)
        for request, k in zip(requests, num_tokens, strict=True):
            self._fed_end[request.req_id] = request.num_tokens + k - 1
            self._preemptions[request.req_id] = request.num_preemptions
        return [drafts[r.req_id] for r in requests]

    def _step(self, seqs: list[tuple[ScheduledSeq, Request]]) -> dict[Request, int]:
        """One draft forward; each slice's greedy next token."""
        by_id = {seq.req_id: request for seq, request in seqs}
        runner = self.runner
        step = runner.prepare_inputs(SchedulerOutput(seqs=[seq for seq, _ in seqs]))
        meta = runner.ops.attention_metadata(
            step.slots, step.decodes, step.prefills, self.block_size, runner.device
        )
        ids = torch.tensor(step.input_ids, device=runner.device)
        positions = torch.tensor(step.positions, device=runner.device)
        hidden = self.decoder(ids, positions, self.kv_caches, meta)  # [T, hidden]
        logits = self.head.compute_logits(hidden[step.sample_rows])  # [S, V]
        tokens = logits.argmax(dim=-1).tolist()
        return {by_id[s.req_id]: t for s, t in zip(step.sample_seqs, tokens, strict=True)}

    def observe(self, step: StepInputs, hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        pass

    def export_state(self, req_id: str) -> None:
        return None  # a decode engine's draft computes its own KV of the prompt

    def import_state(self, request: Request, state: DraftHidden) -> None:
        pass

    def can_draft_on_arrival(self, request: Request) -> bool:
        # A separate draft catches up over the prompt in its own cache; the target's first
        # layers (self-speculation) read the prompt's KV, which is still arriving.
        return not self.shares_kv

    def release(self, req_id: str) -> None:
        self._fed_end.pop(req_id, None)
        self._preemptions.pop(req_id, None)


def _seq(request: Request, token_ids: list[int], start_pos: int) -> tuple[ScheduledSeq, Request]:
    seq = ScheduledSeq(
        req_id=request.req_id,
        token_ids=token_ids,
        start_pos=start_pos,
        block_table=request.block_table,
        sample=True,
        params=request.params,
    )
    return seq, request


def load_draft(name: str, target: ModelConfig) -> tuple[nn.Module, ModelConfig]:
    """Loads a draft model by name or folder; it must share the target's vocabulary."""
    path = resolve_model(name)
    hf_config = complete_config(load_hf_config(path))
    draft = ModelConfig(path=str(path), hf_config=hf_config, max_model_len=target.max_model_len)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model {name!r} has a vocabulary of {draft.vocab_size} tokens, "
            f"the target {target.vocab_size}: a draft model must share the target's tokenizer"
        )
    limit = int(draft.text_config.get("max_position_embeddings") or 2048)
    if limit < target.max_model_len:
        raise ValueError(
            f"speculative_config.model {name!r} takes {limit} positions, fewer than "
            f"max_model_len ({target.max_model_len})"
        )
    model = load_model(model_class(draft.architecture), hf_config, path)
    return model, draft
