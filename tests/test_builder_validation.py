"""The builder refuses settings the models cannot take, with one line, before anything deploys.

No Ray cluster: ``validate_args`` and ``app.config_check`` run in this process (as they do in
`make serve*` before `serve run`, and in Serve's build task). The KV budget check is compared
with the engine itself: the builder accepts a budget exactly when ``LLMEngine`` constructs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.builder import BuildArgs, build_app, validate_args
from app.config_check import check_config
from neuron_runtime.engine import LLMEngine
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.kv_budget import kv_bytes_per_block, kv_capacity_tokens

ROOT = Path(__file__).resolve().parents[1]


def args(model: Path | str, **kwargs: Any) -> BuildArgs:
    return BuildArgs(model=str(model), embedding_model=None, **kwargs)


def copy_without(src: Path, dst: Path, *, drop: str) -> Path:
    """A copy of the model folder without the files whose names match ``drop``."""
    dst.mkdir()
    for file in src.iterdir():
        if not re.search(drop, file.name):
            shutil.copy(file, dst / file.name)
    return dst


# -- args against the model ---------------------------------------------------------------


def test_max_model_len_over_the_models_positions_is_refused_naming_both(tiny_llama_path):
    message = (
        f"model '{tiny_llama_path}': max_model_len 2048 exceeds the model's "
        "max_position_embeddings (1024)"
    )
    with pytest.raises(ValueError) as err:
        validate_args(args(tiny_llama_path, max_model_len=2048))
    assert str(err.value) == message
    # build_app, the import_path target, refuses before binding any deployment.
    with pytest.raises(ValueError, match=re.escape(message)):
        build_app({"model": str(tiny_llama_path), "max_model_len": 2048, "embedding_model": None})


def test_kv_budget_check_agrees_with_the_engine_at_the_boundary(tiny_llama_path):
    """1024 tokens need 64 blocks of 16: a budget of 64.5 blocks fits, 63.5 does not, and
    the engine, built from the same args, agrees on both."""
    probe = EngineArgs(model=str(tiny_llama_path), max_model_len=1024).create_engine_config()
    per_block = kv_bytes_per_block(probe)
    for blocks, fits in ((64, True), (63, False)):
        budget = {"kv_cache_memory_bytes": blocks * per_block + per_block // 2}
        build = args(tiny_llama_path, max_model_len=1024, engine_args=budget)
        config = EngineArgs(**build.full_engine_args()).create_engine_config()
        if fits:
            validate_args(build)
            engine = LLMEngine(config)
            assert engine.runner.num_blocks * config.cache.block_size == kv_capacity_tokens(config)
            continue
        with pytest.raises(ValueError) as err:
            validate_args(build)
        assert str(err.value) == (
            f"model '{tiny_llama_path}': max_model_len 1024 exceeds the KV cache's 1008 tokens "
            f"(engine_args.kv_cache_memory_bytes {budget['kv_cache_memory_bytes']}, blocks of "
            "16 tokens); raise the KV budget or lower max_model_len"
        )
        with pytest.raises(ValueError, match="fewer than max_model_len"):
            LLMEngine(config)


def test_kv_budget_in_blocks_is_named(tiny_llama_path):
    build = args(tiny_llama_path, max_model_len=256, engine_args={"num_kv_blocks": 8})
    with pytest.raises(ValueError, match=r"KV cache's 128 tokens \(engine_args.num_kv_blocks 8,"):
        validate_args(build)


def test_engine_config_limits_are_the_engines_own(tiny_llama_path):
    build = args(
        tiny_llama_path,
        max_model_len=1024,
        engine_args={"enable_chunked_prefill": False, "max_num_batched_tokens": 512},
    )
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(512\) must be >= max_model"):
        validate_args(build)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        validate_args(args(tiny_llama_path, max_model_len=256, engine_args={"block_size": 0}))
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, got 'float16'"):
        validate_args(args(tiny_llama_path, max_model_len=256, engine_args={"dtype": "float16"}))
    validate_args(args(tiny_llama_path, max_model_len=256, engine_args={"dtype": "bfloat16"}))


def test_missing_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match=rf"^model '{tmp_path}/nope': unknown model"):
        validate_args(args(tmp_path / "nope"))


def test_model_without_tokenizer_is_refused(tmp_path, tiny_llama_path):
    folder = copy_without(tiny_llama_path, tmp_path / "m", drop=r"^tokenizer|special_tokens")
    with pytest.raises(ValueError, match=rf"^model '{folder}': the tokenizer in {folder} does"):
        validate_args(args(folder, max_model_len=256))


def test_model_without_or_with_corrupt_weights_is_refused(tmp_path, tiny_llama_path):
    folder = copy_without(tiny_llama_path, tmp_path / "m", drop=r"\.safetensors")
    with pytest.raises(ValueError, match=r"weights in .* do not read: no \*\.safetensors"):
        validate_args(args(folder, max_model_len=256))
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"weights in .* do not read: .*header"):
        validate_args(args(folder, max_model_len=256))


def test_unsupported_architecture_is_refused(tmp_path, tiny_llama_path):
    folder = copy_without(tiny_llama_path, tmp_path / "m", drop="^$")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["NotAModelForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture 'NotAModelForCausalLM'"):
        validate_args(args(folder, max_model_len=256))


def test_embedding_model_must_exist_and_embed(tiny_llama_path):
    with pytest.raises(ValueError, match=r"^embedding_model 'nope': unknown model 'nope'"):
        validate_args(
            args(tiny_llama_path, max_model_len=256).model_copy(update={"embedding_model": "nope"})
        )
    build = args(tiny_llama_path, max_model_len=256).model_copy(
        update={"embedding_model": str(tiny_llama_path)}
    )
    with pytest.raises(ValueError, match=r"\(LlamaForCausalLM\) cannot embed"):
        validate_args(build)


def test_separate_encoder_needs_disaggregated_mode(tiny_llama_path):
    build = args(tiny_llama_path, max_model_len=256, multimodal={"encoder": "separate"})
    with pytest.raises(ValueError, match="'separate' needs mode 'disaggregated'"):
        validate_args(build)


# -- the config file against the app ------------------------------------------------------


def config(model: Path, deployments: list[dict], **build: Any) -> dict[str, Any]:
    app_args = {"model": str(model), "max_model_len": 256, "embedding_model": None, **build}
    app = {
        "name": "a",
        "route_prefix": "/",
        "import_path": "app.builder:build_app",
        "args": app_args,
        "deployments": deployments,
    }
    return {"applications": [app]}


def refusal(cfg: dict[str, Any]) -> str:
    with pytest.raises(ValueError) as err:
        check_config(cfg)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_neuron_cores_only_where_the_engine_runs_on_neuron(tiny_llama_path):
    neuron = {"ray_actor_options": {"num_cpus": 1, "resources": {"neuron_cores": 2}}}
    on_cpu = config(tiny_llama_path, [{"name": "LLMServer", **neuron}])
    assert refusal(on_cpu) == (
        "application 'a': deployment 'LLMServer' asks for neuron_cores but its engine runs on "
        "device 'cpu' (engine_args.device)"
    )
    unpinned = config(tiny_llama_path, [], engine_args={"device": "neuron"})
    assert refusal(unpinned) == (
        "application 'a': engine_args.device 'neuron' needs neuron_cores for deployment "
        "'LLMServer': set its ray_actor_options (resources: {neuron_cores: N})"
    )
    pinned = config(
        tiny_llama_path,
        [{"name": "LLMServer", **neuron}],
        engine_args={"device": "neuron"},
    )
    check_config(pinned)
    on_router = config(
        tiny_llama_path,
        [{"name": "PrefillServer", **neuron}, {"name": "DecodeServer", **neuron}],
        mode="disaggregated",
        engine_args={"device": "neuron"},
    )
    on_router["applications"][0]["deployments"].append({"name": "PDRouter", **neuron})
    assert "deployment 'PDRouter' asks for neuron_cores but it runs on device 'cpu'" in refusal(
        on_router
    )


def test_gpus_only_where_the_engine_runs_on_cuda(tiny_llama_path):
    gpu = {"ray_actor_options": {"num_gpus": 1}}
    assert "deployment 'OpenAIIngress' asks for GPU" in refusal(
        config(tiny_llama_path, [{"name": "OpenAIIngress", **gpu}])
    )
    assert "engine_args.device 'cuda' needs GPU for deployment 'LLMServer'" in refusal(
        config(tiny_llama_path, [], engine_args={"device": "cuda"})
    )


def test_unknown_deployment_and_misspelt_keys_are_refused(tiny_llama_path):
    assert "deployments: 'Prefill' is not a deployment of this application" in refusal(
        config(tiny_llama_path, [{"name": "Prefill", "num_replicas": 1}])
    )
    assert (
        refusal(config(tiny_llama_path, [{"name": "LLMServer", "max_ongoing_request": 4}]))
        == "unknown key applications[0].deployments[0].max_ongoing_request"
    )
    bad_type = config(tiny_llama_path, [], max_model_len="long")
    assert refusal(bad_type).startswith("application 'a': args.max_model_len: Input should be")


def test_the_make_serve_check_fails_fast_with_one_line(tmp_path):
    """`make serve-epd` runs this check before `serve run`: epd.yaml as it once shipped
    (max_model_len 2048 on tiny-llava) stops it at once with one line on stderr."""
    cfg = yaml.safe_load((ROOT / "configs" / "serve" / "epd.yaml").read_text())
    cfg["applications"][0]["args"]["max_model_len"] = 2048
    bad = tmp_path / "epd.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "app.config_check", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: {bad}: application 'neuron-serve': model 'tiny-llava': max_model_len 2048 "
        "exceeds the model's max_position_embeddings (1024)"
    ]


def make_dry_run(*args: str) -> list[str]:
    """The commands `make -n` prints (it runs nothing), continued lines joined."""
    out = subprocess.run(
        ["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return out.replace("\\\n", " ").splitlines()


def test_make_serve_targets_check_the_file_they_run():
    files = {
        "serve": "serve_config.yaml",
        "serve-colocated": "configs/serve/colocated.yaml",
        "serve-epd": "configs/serve/epd.yaml",
    }
    for target, file in files.items():
        commands = make_dry_run(target)
        check = next(i for i, c in enumerate(commands) if "-m app.config_check" in c)
        assert commands[check].split()[-1] == file
        assert commands[check + 1].split()[-3:] == [".venv/bin/serve", "run", file]
        assert "RAY_SERVE_ENABLE_HA_PROXY=1" in commands[check + 1].split()


def test_make_serve_sets_what_the_benchmarks_set():
    """bench/serve.py's `-haproxy` apps run as `make serve` does: with serve_env's variables,
    every one of them on the `serve run` line, the wrapper's path where this checkout keeps it."""
    from app.haproxy_bind import serve_env

    commands = make_dry_run("serve")
    serve = next(c for c in commands if "/serve run " in c).split()
    expected = serve_env(str(ROOT / ".venv" / "bin"))
    assert {f"{name}={value}" for name, value in expected.items()} <= set(serve)


def test_make_serve_takes_serve_haproxy_0_and_another_config_file():
    """What the README offers: Serve's Python proxy instead of HAProxy, and any config file."""
    commands = make_dry_run("serve", "SERVE_HAPROXY=0", "SERVE_CONFIG=configs/serve/epd.yaml")
    check = next(i for i, c in enumerate(commands) if "-m app.config_check" in c)
    assert commands[check].split()[-1] == "configs/serve/epd.yaml"
    serve = commands[check + 1].split()
    assert "RAY_SERVE_ENABLE_HA_PROXY=0" in serve
    assert serve[-3:] == [".venv/bin/serve", "run", "configs/serve/epd.yaml"]
