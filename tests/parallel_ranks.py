"""What each rank of a spawned gloo group runs for tests/test_parallel.py and test_moe.py.

``run_group`` spawns ``world`` processes; each joins the group, checks the collectives
against values it computes itself, then loads every job's model under the job's parallel
config and feeds it one sequence (a prefill chunk, then decodes through the paged cache).
Rank 0's logits come back as numpy arrays.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Job:
    key: str
    path: str
    token_ids: list[int]
    expert_parallel: bool = False


def sequence_logits(model: torch.nn.Module, token_ids: list[int], block_size: int = 4):
    """Logits [n, vocab] of one sequence: the first two thirds as one prefill, then one token
    at a time through the decode path (this rank's kv heads in the cache)."""
    from neuron_runtime.layers.attention import AttentionMetadata, PrefillSlice, decode_groups

    attn = model.decoder_layers[0].self_attn
    n = len(token_ids)
    shape = (attn.num_kv_heads, -(-n // block_size), block_size, attn.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.decoder_layers]
    split = 2 * n // 3
    rows = []
    with torch.inference_mode():
        meta = AttentionMetadata(
            slot_mapping=torch.arange(split),
            num_decode=0,
            prefills=[PrefillSlice(0, split, 0, torch.arange(-(-split // block_size)))],
        )
        hidden = model(torch.tensor(token_ids[:split]), torch.arange(split), caches, meta)
        rows.append(model.compute_logits(hidden))
        for pos in range(split, n):
            used = -(-(pos + 1) // block_size)
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([pos]),
                num_decode=1,
                prefills=[],
                decode_groups=decode_groups([list(range(used))], [pos + 1], block_size),
            )
            hidden = model(torch.tensor([token_ids[pos]]), torch.tensor([pos]), caches, meta)
            rows.append(model.compute_logits(hidden))
    return torch.cat(rows)


def check_collectives(tp: Any) -> dict[str, bool]:
    """Each collective on rank-dependent inputs, against the result worked out by hand."""
    r, size = tp.rank, tp.size
    ok: dict[str, bool] = {}
    x = torch.full((2, 3), float(r + 1))
    ok["all_reduce"] = torch.equal(tp.all_reduce(x.clone()), torch.full((2, 3), 3.0))
    # uneven parts: rank r holds r + 1 columns of value r
    sizes = [i + 1 for i in range(size)]
    got = tp.all_gather(torch.full((2, r + 1), float(r)), dim=-1, sizes=sizes)
    ok["all_gather"] = torch.equal(got, torch.tensor([[0.0, 1.0, 1.0]] * 2))
    rows = torch.arange(4.0).unsqueeze(1) * (r + 1)  # [4, 1]
    ok["reduce_scatter"] = torch.equal(
        tp.reduce_scatter(rows), (torch.arange(4.0) * 3)[2 * r :][:2].unsqueeze(1)
    )
    # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 2 to rank 0, 1 to itself
    send = [1, 2] if r == 0 else [2, 1]
    recv = tp.all_to_all_counts(send)
    ok["all_to_all_counts"] = recv == ([1, 2] if r == 0 else [2, 1])
    payload = torch.arange(3.0).unsqueeze(1) + 10 * r
    got = tp.all_to_all(payload, send, recv)
    expect = [[0.0], [10.0], [11.0]] if r == 0 else [[1.0], [2.0], [12.0]]
    ok["all_to_all"] = torch.equal(got, torch.tensor(expect))
    ok["broadcast"] = torch.equal(
        tp.broadcast(torch.tensor([float(r + 5)]), src=1), torch.tensor([6.0])
    )
    ok["broadcast_object"] = tp.broadcast_object({"r": r} if r == 0 else None) == {"r": 0}
    gathered = tp.gather_object(r * 10)
    ok["gather_object"] = gathered == [0, 10] if r == 0 else gathered is None
    return ok


def _rank_main(rank: int, world: int, init_method: str, jobs: list[Job], queue: Any) -> None:
    torch.set_num_threads(1)
    from neuron_runtime.config import ParallelConfig
    from neuron_runtime.loader import load_hf_config, load_model
    from neuron_runtime.models.registry import model_class
    from neuron_runtime.parallel.collectives import destroy_world, init_world
    from neuron_runtime.parallel.state import build_parallel_state, use_parallel_state

    init_world("gloo", rank, world, init_method, 300.0)
    try:
        state = build_parallel_state(ParallelConfig(tensor_parallel_size=world), rank, "gloo")
        results: dict[str, Any] = {"collectives": check_collectives(state.tp)}
        for job in jobs:
            config = ParallelConfig(world, enable_expert_parallel=job.expert_parallel)
            cfg = load_hf_config(job.path)
            with use_parallel_state(build_parallel_state(config, rank, "gloo")):
                model = load_model(model_class(cfg["architectures"][0]), cfg, job.path)
            results[job.key] = sequence_logits(model, job.token_ids).numpy()
        if rank == 0:
            queue.put(results)
    except BaseException as exc:  # the parent reports it
        queue.put({"error": f"rank {rank}: {exc!r}"})
        raise
    finally:
        destroy_world()


def run_group(jobs: list[Job], world: int = 2, timeout_s: float = 300.0) -> dict[str, Any]:
    """Rank 0's results of ``jobs`` run by ``world`` spawned gloo ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, f"tcp://127.0.0.1:{port}", jobs, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        results = queue.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if "error" in results:
        raise RuntimeError(results["error"])
    return results


def as_tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array)
