"""Data parallelism: ``data_parallel_size`` as engine replicas in the Serve app, and DP ranks
that share a mixture-of-experts model's experts (expert parallel over DP * TP ranks).

- The builder maps ``data_parallel_size`` N to N replicas of the engine deployment, each an
  engine of one DP rank (no ``data_parallel_size`` in its engine args); a replica count or
  autoscaling beside it is refused, in the code's options and in a Serve config. (The router
  spreading requests over DP replicas is checked on a live app in test_parallel_pd.py.)
- Two gloo ranks as two DP replicas of tiny Qwen3-MoE and Mixtral models built with
  transformers' classes, experts spread over both (EP over DP): each rank feeds its own
  sequence, its (token, expert) pairs travel to the other rank's experts and back, and each
  rank's logits equal one unsharded model's on that sequence within 1e-4.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Any

import pytest
import torch
from conftest import make_tiny_model
from parallel_ranks import sequence_logits
from test_moe import MOE_FAMILIES

from neuron_runtime.loader import load_hf_config, load_model
from neuron_runtime.models.registry import model_class

LOGIT_ATOL = 1e-4
# One sequence per DP rank, the same length (the ranks step in lockstep).
SEQUENCES = [
    [1, 504, 3458, 314, 4649, 28, 284, 260, 1589, 282, 260, 4197, 30, 378, 7, 1001],
    [1, 33, 2030, 17, 9, 4005, 711, 88, 3120, 5, 61, 402, 1999, 12, 300, 47],
]


# -- the builder ----------------------------------------------------------------------------


def _built(args: dict[str, Any], **options: Any) -> dict[str, Any]:
    from ray.serve._private.build_app import build_app

    from app.builder import BuildArgs, build_openai_app

    app = build_openai_app(BuildArgs(**args), **options)
    return {d.name: d for d in build_app(app, name="dp").deployments}


def test_data_parallel_size_becomes_engine_replicas():
    colocated = _built(
        {"max_model_len": 256, "embedding_model": None, "engine_args": {"data_parallel_size": 3}}
    )
    server = colocated["LLMServer"]
    assert server.num_replicas == 3
    engine_args = server.init_args[0]
    assert "data_parallel_size" not in engine_args  # each replica is one DP rank
    pd = _built(
        {
            "mode": "disaggregated",
            "max_model_len": 256,
            "embedding_model": None,
            "engine_args": {"data_parallel_size": 2},
            "decode": {"engine_args": {"data_parallel_size": 4, "tensor_parallel_size": 2}},
            "disaggregation": {"kv_transport": "object_store"},
        },
        decode_options={"ray_actor_options": {"num_cpus": 0.5, "resources": {"neuron_cores": 1}}},
    )
    assert pd["PrefillServer"].num_replicas == 2
    decode = pd["DecodeServer"]
    assert decode.num_replicas == 4
    # each decode replica: a placement group of one bundle per TP rank, ranks as Ray actors
    assert decode._replica_config.placement_group_bundles == [{"CPU": 0.5, "neuron_cores": 1.0}] * 2
    assert decode.init_args[0]["distributed_executor_backend"] == "ray"
    assert pd["PrefillServer"]._replica_config.placement_group_bundles is None


def test_data_parallel_size_with_another_replica_count_is_refused():
    from app.builder import BuildArgs, build_openai_app, validate_args
    from app.config_check import check_config

    args = {"max_model_len": 256, "embedding_model": None, "engine_args": {"data_parallel_size": 2}}
    with pytest.raises(ValueError, match="data_parallel_size 2 fixes LLMServer's replicas at 2"):
        build_openai_app(BuildArgs(**args), llm_options={"num_replicas": 3})
    with pytest.raises(ValueError, match=r"decode.engine_args.data_parallel_size must be an int"):
        validate_args(
            BuildArgs(
                **{
                    **args,
                    "mode": "disaggregated",
                    "decode": {"engine_args": {"data_parallel_size": 0}},
                }
            )
        )
    config = {
        "applications": [
            {
                "name": "dp",
                "import_path": "app.builder:build_app",
                "args": args,
                "deployments": [
                    {"name": "LLMServer", "autoscaling_config": {"min_replicas": 1}},
                ],
            }
        ]
    }
    with pytest.raises(ValueError, match="'LLMServer': data_parallel_size 2 fixes its replicas"):
        check_config(config)


# -- DP ranks sharing experts ---------------------------------------------------------------


def _rank_main(rank: int, tp: int, init_method: str, paths: dict[str, str], queue: Any) -> None:
    torch.set_num_threads(1)
    from neuron_runtime.config import ParallelConfig
    from neuron_runtime.parallel.collectives import destroy_world, init_world
    from neuron_runtime.parallel.state import build_parallel_state, use_parallel_state

    config = ParallelConfig(
        tensor_parallel_size=tp, data_parallel_size=2, enable_expert_parallel=True
    )
    init_world("gloo", rank, config.world_size, init_method, 300.0)
    try:
        state = build_parallel_state(config, rank, "gloo")
        assert (state.tp.size, state.dp.size, state.ep.size) == (tp, 2, 2 * tp)
        dp_rank = rank // tp
        results: dict[str, Any] = {"rank": rank}
        for name, path in paths.items():
            cfg = load_hf_config(path)
            with use_parallel_state(state):
                model = load_model(model_class(cfg["architectures"][0]), cfg, path)
            experts = model.decoder_layers[0].mlp
            logits = sequence_logits(model, SEQUENCES[dp_rank])
            results[name] = (experts.num_local, logits.numpy())
        queue.put(results)
    except BaseException as exc:  # the parent reports it
        queue.put({"rank": rank, "error": repr(exc)})
        raise
    finally:
        destroy_world()


def _run_dp_group(paths: dict[str, str], tp: int) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, tp, f"tcp://127.0.0.1:{port}", paths, queue))
        for r in range(2 * tp)
    ]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors
    return sorted(results, key=lambda r: r["rank"])


@pytest.mark.parametrize(
    ("tp", "families"),
    [(1, ("qwen3_moe", "mixtral")), (2, ("mixtral",))],
    ids=["dp2", "dp2xtp2"],
)
def test_dp_ranks_with_experts_spread_over_them_match_one_rank(
    tp, families, tmp_path_factory, default_model_path
):
    """DP=2 (2 ranks, 4 experts each) and DP=2 x TP=2 (4 ranks, 2 experts each: attention
    sharded within each replica, its one kv head replicated, the token shares gathered over
    its TP group)."""
    paths = {
        name: str(
            make_tiny_model(
                tmp_path_factory.mktemp(f"dp-{name}"), default_model_path, arch, settings, True
            )
        )
        for name, (arch, settings) in MOE_FAMILIES.items()
        if name in families
    }
    ranks = _run_dp_group(paths, tp)
    for name, path in paths.items():
        cfg = load_hf_config(path)
        single = load_model(model_class(cfg["architectures"][0]), cfg, path)
        wants = [sequence_logits(single, tokens) for tokens in SEQUENCES]
        for rank, result in enumerate(ranks):
            num_local, logits = result[name]
            assert num_local == 8 // (2 * tp)  # the experts spread over every rank
            want = wants[rank // tp]
            got = torch.from_numpy(logits)
            torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)
            assert torch.equal(got.argmax(-1), want.argmax(-1)), (name, rank)
