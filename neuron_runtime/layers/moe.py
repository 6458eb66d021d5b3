"""Mixture-of-experts block: top-k routing, the experts stacked into two tensors, and their
split over ranks (tensor or expert parallel).

Weights, per layer: ``w13_weight`` [E_local, 2 * I_local, H] (each expert's gate then up rows)
and ``w2_weight`` [E_local, H, I_local]. The router (``gate``) is replicated.

- One rank (``fused``): tokens are sorted by expert and each expert with tokens runs once over
  all of them (two GEMMs), its output scaled by the routing weight and added to its tokens.
- Tensor parallel: every rank holds every expert's slice of the intermediate size; the partial
  outputs are summed with an all-reduce (as the dense MLP's down_proj).
- Expert parallel: each rank holds E / ep whole experts. The activations are the same on every
  rank of a TP group (attention is tensor parallel), so each rank routes its own share of the
  tokens, sends each (token, expert) pair to the expert's rank with an all-to-all, runs its
  experts on what it received, sends the results back with a second all-to-all, adds them to
  its tokens and all-gathers the token shares over the TP group. Under data parallelism the
  EP group spans every replica's ranks (DP * TP), whose tokens differ: the same two
  all-to-alls carry each replica's pairs to whichever rank holds the expert.

Routing is softmax over the experts, the top-k kept, renormalized to sum 1 when the model says
so (Mixtral always; Qwen3-MoE with ``norm_topk_prob``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from neuron_runtime.backends.ops import TORCH_OPS, Ops
from neuron_runtime.layers.linear import Linear
from neuron_runtime.parallel.layers import Slice, split_evenly
from neuron_runtime.parallel.state import parallel_state

# A checkpoint tensor this rank needs none of (an expert another rank holds).
SKIP: Slice = (0, 0, 0)


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, top-k: (weights [T, k] float32, expert ids [T, k] long)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """The experts of one layer and their router; ``forward`` takes and returns [T, H]."""

    ops: Ops = TORCH_OPS

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden: int,
        intermediate: int,
        renormalize: bool,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        state = parallel_state()
        self.tp, self.ep = state.tp, state.ep
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.act_fn = act_fn
        if self.ep.size > 1:  # whole experts per rank
            self.expert_start, self.num_local = split_evenly(
                num_experts, self.ep.size, self.ep.rank
            )
            self.inter_part = (0, intermediate)
        else:  # every expert, a slice of each
            self.expert_start, self.num_local = 0, num_experts
            self.inter_part = split_evenly(intermediate, self.tp.size, self.tp.rank)
        inter = self.inter_part[1]
        self.gate = Linear(hidden, num_experts, bias=False)
        self.w13_weight = nn.Parameter(torch.empty(self.num_local, 2 * inter, hidden))
        self.w2_weight = nn.Parameter(torch.empty(self.num_local, hidden, inter))
        # expert id -> first expert of each rank (expert parallel): [ep + 1]
        bounds = [split_evenly(num_experts, self.ep.size, r)[0] for r in range(self.ep.size)]
        self.rank_bounds = torch.tensor([*bounds, num_experts])

    # Checkpoint mapping: one tensor per expert and projection ------------------------------
    def holds(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.num_local

    def checkpoint_slice(self, param: str, shard: int | None) -> Slice | None:
        """``shard`` is ``expert * 3 + part`` (0 gate, 1 up, 2 down)."""
        if shard is None:
            return None
        expert, part = divmod(shard, 3)
        if not self.holds(expert):
            return SKIP
        if self.tp.size == 1 or self.ep.size > 1:
            return None
        return (1 if part == 2 else 0, *self.inter_part)

    def shard_view(self, param: torch.Tensor, shard: int) -> torch.Tensor:
        """Where expert ``shard // 3``'s part ``shard % 3`` goes in ``param``."""
        expert, part = divmod(shard, 3)
        local = expert - self.expert_start
        if part == 2:
            return param[local]
        inter = self.inter_part[1]
        return param[local, part * inter : (part + 1) * inter]

    def expected_shards(self) -> dict[str, list[int]]:
        experts = range(self.expert_start, self.expert_start + self.num_local)
        return {
            "w13_weight": [e * 3 + p for e in experts for p in (0, 1)],
            "w2_weight": [e * 3 + 2 for e in experts],
        }

    # Forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)  # [T, k] each
        if self.ep.size > 1:
            return self._expert_parallel(x, weights, ids)
        out = self._run_experts(x, ids.flatten(), weights.flatten(), ids.shape[1])
        return self.tp.all_reduce(out) if self.tp.size > 1 else out

    def _run_experts(
        self,
        x: torch.Tensor,  # [N, H] token rows
        expert_ids: torch.Tensor,  # [N * k] global ids of the (token, slot) pairs, all local
        weights: torch.Tensor,  # [N * k] routing weights
        k: int,  # slots per token row
    ) -> torch.Tensor:
        """Sum over each row's slots of weight * expert(row): [N, H]."""
        out = torch.zeros_like(x)
        local = expert_ids - self.expert_start
        order = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=self.num_local).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]
            start += n
            rows = pairs // k
            h = self.ops.act_and_mul(F.linear(x[rows], self.w13_weight[e]), self.act_fn)
            y = F.linear(h, self.w2_weight[e])  # [n, H]
            out.index_add_(0, rows, y * weights[pairs].unsqueeze(-1).to(y.dtype))
        return out

    def _expert_parallel(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        ep, tp = self.ep, self.tp
        num_tokens, hidden = x.shape
        # This TP group's tokens, a share per TP rank (every token with TP=1).
        sizes = [split_evenly(num_tokens, tp.size, r)[1] for r in range(tp.size)]
        first, mine = split_evenly(num_tokens, tp.size, tp.rank)
        k = ids.shape[1]
        pair_ids = ids[first : first + mine].flatten()  # [mine * k] this rank's pairs
        pair_weights = weights[first : first + mine].flatten()
        # Pairs in expert order: grouped by the rank that holds the expert.
        order = torch.argsort(pair_ids, stable=True)
        dest = torch.bucketize(pair_ids[order], self.rank_bounds[1:], right=True)
        send_counts = torch.bincount(dest, minlength=ep.size).tolist()
        recv_counts = ep.all_to_all_counts(send_counts)
        # One row per pair: the token's hidden state, its expert, its weight.
        packed = torch.cat(
            (
                x[first + order // k],
                pair_ids[order].unsqueeze(-1).to(x.dtype),
                pair_weights[order].unsqueeze(-1).to(x.dtype),
            ),
            dim=-1,
        )
        got = ep.all_to_all(packed, send_counts, recv_counts)  # [R, H + 2]
        got_ids = got[:, hidden].round().long()
        done = self._run_experts(got[:, :hidden], got_ids, got[:, hidden + 1], 1)
        back = ep.all_to_all(done, recv_counts, send_counts)  # [mine * k, H], in `order`
        out = torch.zeros(mine, hidden, dtype=x.dtype, device=x.device)
        out.index_add_(0, order // k, back)
        return tp.all_gather(out, dim=0, sizes=sizes) if tp.size > 1 else out
