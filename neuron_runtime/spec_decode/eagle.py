"""EAGLE and EAGLE-3 proposers: a small head over the target's embeddings and hidden states.

Checkpoint layouts (a folder with config.json and safetensors, as published):
- EAGLE (``method: eagle``): ``fc.weight`` [H, 2H] (``fc.bias`` optional), one Llama decoder
  layer ``layers.0.*`` without ``input_layernorm``; logits from the target's lm_head.
  ``embed_tokens.weight``, if present, is ignored: the target's embeddings are used.
- EAGLE-3 (``method: eagle3``): ``fc.weight`` [H, 3H] over three of the target's hidden states,
  ``midlayer.*`` (``input_layernorm``, ``hidden_norm``, attention whose q/k/v take [2H],
  ``post_attention_layernorm``, mlp), ``norm.weight``, its own ``lm_head.weight``
  [draft_vocab, H] and ``d2t`` (draft id -> target id offset); ``t2d`` is ignored.

The head's input at position p is the embedding of token p + 1 with the target's hidden state
at p (which predicted that token); its output predicts token p + 2. Drafting after position
T - 1 (the last token, not yet computed by the target):

    catch-up:  positions from the first the head has not seen with the target's hidden states
               up to T - 2 (whose token input is the last token) -> d1
    k - 1 x:   position T - 2 + i, token d_i, the head's own previous hidden -> d_{i+1}

The head's KV (one layer) sits at the target's block ids in a cache of its own; the drafted
positions are run again with the target's hidden states once verified.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from neuron_runtime.config import EngineConfig
from neuron_runtime.kv_transfer import DraftHidden, KVTransferError
from neuron_runtime.layers.linear import Linear
from neuron_runtime.layers.logits import LogitsHead
from neuron_runtime.layers.norm import RMSNorm
from neuron_runtime.layers.rotary import RotaryEmbedding, rope_parameters
from neuron_runtime.loader import copy_weights, iter_weights, load_hf_config
from neuron_runtime.model_store import resolve_model
from neuron_runtime.models.llama import KVCache, LlamaAttention, LlamaMLP
from neuron_runtime.request import Request
from neuron_runtime.scheduler import ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from neuron_runtime.model_runner import ModelRunner, ModelRunnerOutput, StepInputs

FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
FUSED_MLP = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def fuse_projections(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF q/k/v and gate/up projections -> our fused ``qkv_proj`` / ``gate_up_proj``."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        parent, _, leaf = name.rpartition(".")
        module = parent.rpartition(".")[2]
        if module in FUSED or module in FUSED_MLP:
            continue
        out[name] = tensor
    for parts, fused in (
        (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
        (("gate_proj", "up_proj"), "gate_up_proj"),
    ):
        for name in [n for n in weights if f".{parts[0]}." in n]:
            names = [name.replace(f".{parts[0]}.", f".{p}.") for p in parts]
            out[name.replace(f".{parts[0]}.", f".{fused}.")] = torch.cat(
                [weights[n] for n in names]
            )
    return out


class EagleHead(nn.Module):
    """EAGLE (-1): ``fc(cat(embed, hidden))``, then one decoder layer without an input norm."""

    def __init__(self, cfg: dict[str, Any], fc_bias: bool) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.fc = Linear(2 * hidden, hidden, bias=fc_bias)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.get("rms_norm_eps", 1e-6))
        self.mlp = LlamaMLP(cfg)
        self.rotary = _rotary(cfg)

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H]
        hidden: torch.Tensor,  # [T, H]: the target's (catch-up) or this head's last output
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        meta: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(states for the target's lm_head, states fed to the next draft step), [T, H] each."""
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        residual = x
        x = self.self_attn(x, self.rotary.lookup(positions), kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        out = self.mlp(x) + residual
        return out, out


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(cfg)
        attn = self.self_attn
        # q/k/v read the normed embedding and hidden state side by side: [2H] in.
        attn.qkv_proj = Linear(2 * hidden, attn.q_size + 2 * attn.kv_size, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = LlamaMLP(cfg)


class Eagle3Head(nn.Module):
    """EAGLE-3: fc over three target hidden states, one ``midlayer``, its own vocabulary."""

    def __init__(self, cfg: dict[str, Any], target_vocab: int) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.hidden_size = hidden
        self.fc = Linear(3 * hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(hidden, cfg.get("rms_norm_eps", 1e-6))
        draft_vocab = int(cfg.get("draft_vocab_size") or target_vocab)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.logits_head = LogitsHead()
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.rotary = _rotary(cfg)

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H]
        hidden: torch.Tensor,  # [T, 3H] from the target (catch-up) or [T, H] from this head
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden.shape[-1] != self.hidden_size:
            hidden = self.fc(hidden)
        layer = self.midlayer
        residual = hidden
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        x = layer.self_attn(x, self.rotary.lookup(positions), kv_cache, meta)
        x, residual = layer.post_attention_layernorm.add_and_norm(x, residual)
        x = layer.mlp(x)
        normed, prenorm = self.norm.add_and_norm(x, residual)
        return normed, prenorm

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """Greedy target token ids [S] from this head's own vocabulary."""
        draft = self.logits_head(normed, self.lm_head.weight).argmax(dim=-1)
        return draft + self.d2t[draft]


def _rotary(cfg: dict[str, Any]) -> RotaryEmbedding:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return RotaryEmbedding(head_dim, cfg.get("max_position_embeddings", 4096), rope_parameters(cfg))


def aux_layer_ids(cfg: dict[str, Any], num_layers: int) -> list[int]:
    """The target layers whose inputs EAGLE-3 reads: the head's ``eagle_config`` or, as in
    vLLM, (2, L // 2, L - 3) clamped to the model's layers."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = [2, num_layers // 2, num_layers - 3]
    return [min(max(int(i), 0), num_layers - 1) for i in ids]


def load_head(
    method: str, name: str, target_cfg: dict[str, Any], target_vocab: int
) -> tuple[nn.Module, dict[str, Any]]:
    """Builds and loads an EAGLE / EAGLE-3 head from its published folder layout."""
    path = resolve_model(name)
    cfg = load_hf_config(path)
    if cfg.get("hidden_size") != target_cfg["hidden_size"]:
        raise ValueError(
            f"speculative_config.model {name!r} has hidden_size {cfg.get('hidden_size')}, the "
            f"target {target_cfg['hidden_size']}: an EAGLE head must match its target"
        )
    weights = dict(iter_weights(path))
    weights.pop("embed_tokens.weight", None)  # the target's embeddings are used
    if method == "eagle":
        weights = {k.removeprefix("layers.0."): v for k, v in weights.items()}
        head: nn.Module = EagleHead(cfg, fc_bias="fc.bias" in weights)
    else:
        weights.pop("t2d", None)
        d2t = weights.pop("d2t", None)
        head = Eagle3Head(cfg, target_vocab)
        if d2t is not None:
            head.d2t.copy_(d2t.long())
    copy_weights(head, fuse_projections(weights).items(), f"{method} head")
    return head.eval(), cfg


class EagleProposer:
    """Drafts greedily with an EAGLE or EAGLE-3 head."""

    needs_slots = True

    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        spec = config.speculative
        assert spec is not None and spec.model is not None
        self.runner = runner
        self.device = runner.device
        self.block_size = config.cache.block_size
        self.eagle3 = spec.method == "eagle3"
        head, cfg = load_head(
            spec.method, spec.model, config.model.text_config, config.model.vocab_size
        )
        self.head: Any = runner.backend.prepare_model(head)
        kv_heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        shape = runner.kv_caches[0][0].shape  # [kvh, num_blocks, block_size, head_dim]
        cache_shape = (kv_heads, shape[1], shape[2], head_dim)
        self.kv_cache = (
            torch.zeros(cache_shape, dtype=runner.kv_dtype, device=runner.device),
            torch.zeros(cache_shape, dtype=runner.kv_dtype, device=runner.device),
        )
        # req_id -> (first position, the target's hidden states from there on) not yet
        # consumed by the head; rows past num_computed_tokens (rejected drafts) are dropped.
        self._pending: dict[str, tuple[int, torch.Tensor]] = {}
        self._head_end: dict[str, tuple[int, int]] = {}  # req_id -> (position, preemptions)
        # EAGLE-3: the inputs of these target layers, captured during each target forward.
        self._aux_ids: list[int] = []
        self._aux: dict[int, torch.Tensor] = {}
        if self.eagle3:
            layers = runner.model.decoder_layers
            self._aux_ids = aux_layer_ids(cfg, len(layers))
            for i in sorted(set(self._aux_ids)):
                layers[i].register_forward_pre_hook(partial(self._capture, i))
        # Width of the target features the head reads per position.
        self.feature_size = int(cfg["hidden_size"]) * (len(self._aux_ids) if self.eagle3 else 1)

    def _capture(self, layer_idx: int, module: nn.Module, args: tuple[Any, ...]) -> None:
        x, residual = args[0], args[1]
        self._aux[layer_idx] = x.clone() if residual is None else x + residual  # [T, H]

    def observe(self, step: StepInputs, hidden: torch.Tensor, result: ModelRunnerOutput) -> None:
        """Keeps the target's hidden states of every slice (EAGLE-3: its three layers')."""
        if self.eagle3:
            features = torch.cat([self._aux[i] for i in self._aux_ids], dim=-1)  # [T, 3H]
            self._aux = {}
        else:
            features = hidden  # [T, H]
        row = 0
        for seq in step.seqs:
            n = len(seq.token_ids)
            rows = features[row : row + n].clone()
            row += n
            pending = self._pending.get(seq.req_id)
            if pending is not None and pending[0] <= seq.start_pos <= pending[0] + len(pending[1]):
                start, kept = pending
                rows = torch.cat([kept[: seq.start_pos - start], rows])
                self._pending[seq.req_id] = (start, rows)
            else:
                self._pending[seq.req_id] = (seq.start_pos, rows)

    def export_state(self, req_id: str) -> DraftHidden | None:
        """Prefill role: the target's hidden states of a handed-off prompt (what ``observe``
        kept of it), for the decode engine's head; forgotten here."""
        self._head_end.pop(req_id, None)
        pending = self._pending.pop(req_id, None)
        if pending is None:
            return None
        start, rows = pending
        return DraftHidden(start, rows.cpu().numpy())

    def import_state(self, request: Request, state: DraftHidden) -> None:
        """Decode role: a handed-off prompt's hidden states, as if this engine had computed
        them; KVTransferError when they do not fit the prompt or this head."""
        rows = state.hidden
        num_prompt = request.num_prompt_tokens
        if (
            rows.dtype != np.float32
            or rows.ndim != 2
            or rows.shape[1] != self.feature_size
            or not 0 <= state.start < num_prompt
            or state.start + rows.shape[0] != num_prompt
        ):
            raise KVTransferError(
                f"EAGLE hidden states {rows.dtype} {tuple(rows.shape)} from position "
                f"{state.start} do not fit a {num_prompt}-token prompt and a head reading "
                f"float32 [n, {self.feature_size}]"
            )
        self._pending[request.req_id] = (state.start, torch.tensor(rows, device=self.device))
        self._head_end.pop(request.req_id, None)

    def can_draft_on_arrival(self, request: Request) -> bool:
        """Whether the head can draft before the request's first target step here: only from
        handed-off hidden states."""
        return request.req_id in self._pending

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        seqs: list[ScheduledSeq] = []
        features: dict[str, torch.Tensor] = {}
        for request in requests:
            start, rows = self._pending[request.req_id]
            end = request.num_computed_tokens  # the target's hidden states reach end - 1
            first = start
            seen = self._head_end.get(request.req_id)
            if seen is not None and seen[1] == request.num_preemptions:
                first = max(start, min(seen[0], end - 1))
            ids = request.all_token_ids[first + 1 : end + 1]  # token p + 1 at position p
            seqs.append(_seq(request, ids, first))
            features[request.req_id] = rows[first - start : end - start]
            self._pending[request.req_id] = (end, rows[:0])
            self._head_end[request.req_id] = (end, request.num_preemptions)
        by_id = {r.req_id: r for r in requests}
        k_of = {r.req_id: k for r, k in zip(requests, num_tokens, strict=True)}
        tokens, last = self._step(seqs, features)
        drafts = {req_id: [t] for req_id, t in tokens.items()}
        for i in range(1, max(num_tokens)):
            seqs = [
                _seq(by_id[r], [d[-1]], by_id[r].num_computed_tokens - 1 + i)
                for r, d in drafts.items()
                if k_of[r] > i
            ]
            tokens, last = self._step(seqs, {s.req_id: last[s.req_id] for s in seqs})
            for req_id, token in tokens.items():
                drafts[req_id].append(token)
        return [drafts[r.req_id] for r in requests]

    def _step(
        self, seqs: list[ScheduledSeq], features: dict[str, torch.Tensor]
    ) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
        """One head forward: each slice's greedy next token and its last output state."""
        runner = self.runner
        step = runner.prepare_inputs(SchedulerOutput(seqs=seqs))
        meta = runner.ops.attention_metadata(
            step.slots, step.decodes, step.prefills, self.block_size, runner.device
        )
        ids = torch.tensor(step.input_ids, device=runner.device)
        positions = torch.tensor(step.positions, device=runner.device)
        hidden_in = torch.cat([features[s.req_id] for s in step.seqs])  # rows in step order
        embeds = runner.model.embed_input_ids(ids)
        normed, nxt = self.head(embeds, hidden_in, positions, self.kv_cache, meta)
        rows = step.sample_rows
        if self.eagle3:
            tokens = self.head.draft_tokens(normed[rows])
        else:
            tokens = runner.model.compute_logits(normed[rows]).argmax(dim=-1)
        ids_out = {s.req_id: int(t) for s, t in zip(step.sample_seqs, tokens, strict=True)}
        states = {s.req_id: nxt[r : r + 1] for s, r in zip(step.sample_seqs, rows, strict=True)}
        return ids_out, states

    def release(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self._head_end.pop(req_id, None)


def _seq(request: Request, token_ids: list[int], start_pos: int) -> ScheduledSeq:
    return ScheduledSeq(
        req_id=request.req_id,
        token_ids=token_ids,
        start_pos=start_pos,
        block_table=request.block_table,
        sample=True,
        params=request.params,
    )
