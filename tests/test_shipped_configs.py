"""Every shipped Serve config deploys as written and answers: serve_config.yaml, configs/serve/.

Each file is deployed through the controller's config path (``ServeDeploySchema`` ->
``deploy_apps``, what `serve run CONFIG` and `serve deploy` do), changing only the HTTP port,
on the shared cluster (conftest.serve_cluster). The deployed options are compared with the
file's, one request of each kind the app serves is sent with the openai client (a chat, an
image chat for a vision-language model, an embedding when the app has an embedding model) and
compared with the offline engine on the same model, the engines return to idle, and the app
is deleted. Files whose deployments ask for ``neuron_cores`` (Trainium) are only checked.
"""

from __future__ import annotations

import base64
import io
import time
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
from conftest import busy_engines  # noqa: E402
from PIL import Image  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.context import _get_global_client  # noqa: E402
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from app.builder import BuildArgs, has_vision_tower  # noqa: E402
from app.config_check import ENGINE_DEPLOYMENTS, check_config  # noqa: E402
from neuron_runtime import LLM, SamplingParams  # noqa: E402
from neuron_runtime.embedding import EmbeddingEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [ROOT / "serve_config.yaml", *sorted((ROOT / "configs" / "serve").glob("*.yaml"))]
IDS = [str(path.relative_to(ROOT)) for path in CONFIGS]
QUESTION = "What is the capital of France?"
MAX_TOKENS = 8


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def asks_for_neuron_cores(config: dict[str, Any]) -> bool:
    return any(
        "neuron_cores" in ((d.get("ray_actor_options") or {}).get("resources") or {})
        for app in config["applications"]
        for d in app.get("deployments", [])
    )


def asks_for_gpus(config: dict[str, Any]) -> bool:
    return any(
        (d.get("ray_actor_options") or {}).get("num_gpus")
        for app in config["applications"]
        for d in app.get("deployments", [])
    )


@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_config_parses_and_its_args_fit_the_models(path: Path) -> None:
    """What the Makefile's serve targets run before `serve run` (no cluster)."""
    schema = check_config(load(path))
    assert [app.import_path for app in schema.applications] == ["app.builder:build_app"] * len(
        schema.applications
    )


@pytest.mark.ray
@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_config_deploys_as_written_and_answers(path: Path, serve_cluster: str) -> None:
    config = load(path)
    if asks_for_neuron_cores(config):
        pytest.skip(f"{path.name} asks for neuron_cores: it deploys only on Trainium nodes")
    if asks_for_gpus(config):
        pytest.skip(f"{path.name} asks for GPUs: it deploys only on GPU nodes")
    config["http_options"]["port"] = int(serve_cluster.rsplit(":", 1)[1])
    schema = ServeDeploySchema.model_validate(config)
    client = _get_global_client()
    client.deploy_apps(schema)
    try:
        for app in config["applications"]:
            details = wait_running(app["name"])
            check_deployed_options(app, details)
            args = BuildArgs(**app["args"])
            ask(serve_cluster + app["route_prefix"].rstrip("/"), args)
            wait_idle(app["name"], details)
            assert not any(d["recent_dead_replicas"] for d in details["deployments"].values())
    finally:
        for app in config["applications"]:
            serve.delete(app["name"])


@pytest.mark.ray
def test_a_config_the_model_cannot_take_fails_to_build_without_starting_replicas(
    serve_cluster: str,
) -> None:
    """epd.yaml as it shipped before: max_model_len 2048 on tiny-llava (1024 positions)."""
    config = load(ROOT / "configs" / "serve" / "epd.yaml")
    config["applications"][0]["args"]["max_model_len"] = 2048
    config["applications"][0]["name"] = "too-long"
    config["applications"][0]["route_prefix"] = "/too-long"
    client = _get_global_client()
    client.deploy_apps(ServeDeploySchema.model_validate(config))
    try:
        deadline = time.monotonic() + 60
        while True:
            app = client.get_serve_details()["applications"].get("too-long", {})
            if app.get("status") == "DEPLOY_FAILED":
                break
            assert time.monotonic() < deadline, f"still {app.get('status')}"
            time.sleep(0.5)
        assert (
            "model 'tiny-llava': max_model_len 2048 exceeds the model's "
            "max_position_embeddings (1024)" in app["message"]
        )
        assert app["deployments"] == {}, "no deployment was created"
    finally:
        serve.delete("too-long")


# -- helpers ------------------------------------------------------------------------------


def wait_running(name: str, timeout_s: float = 600.0) -> dict[str, Any]:
    client = _get_global_client()
    deadline = time.monotonic() + timeout_s
    while True:
        app = client.get_serve_details()["applications"].get(name, {})
        status = app.get("status")
        assert status != "DEPLOY_FAILED", app.get("message")
        if status == "RUNNING":
            return app
        assert time.monotonic() < deadline, f"{name} still {status}: {app.get('message')}"
        time.sleep(1.0)


def contains(expected: Any, actual: Any) -> bool:
    """Every value the file sets is the deployed one (Serve fills in the rest)."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            contains(v, actual.get(k)) for k, v in expected.items()
        )
    return expected == actual


def check_deployed_options(app: dict[str, Any], details: dict[str, Any]) -> None:
    deployed = details["deployments"]
    for written in app["deployments"]:
        live = deployed[written["name"]]
        options = live["deployment_config"]
        for key, value in written.items():
            assert contains(value, options.get(key)), (written["name"], key, options.get(key))
        replicas = [r for r in live["replicas"] if r["state"] == "RUNNING"]
        autoscaling = written.get("autoscaling_config") or {}
        wanted = written.get("num_replicas") or autoscaling.get("min_replicas", 1)
        assert len(replicas) == wanted, (written["name"], len(replicas))


def png(seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@cache
def offline(model: str, max_model_len: int) -> LLM:
    return LLM(model=model, max_model_len=max_model_len, num_kv_blocks=max_model_len // 16)


def ask(base: str, args: BuildArgs) -> None:
    """One chat (an image chat for a vision-language model) and one embedding, each equal to
    the offline engine's answer on the same model."""
    api = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=180)
    content: Any = QUESTION
    if has_vision_tower(args.model):
        url = "data:image/png;base64," + base64.b64encode(png(1)).decode()
        content = [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": QUESTION},
        ]
    chat = [{"role": "user", "content": content}]
    reply = api.chat.completions.create(
        model=args.served_model_name or args.model,
        messages=chat,
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage.completion_tokens == MAX_TOKENS
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = offline(args.model, args.max_model_len).chat(chat, params)[0].outputs[0].text
    assert reply.choices[0].message.content == expected
    if args.embedding_model:
        texts = ["hello", QUESTION]
        got = api.embeddings.create(model=args.embedding_model, input=texts)
        reference = EmbeddingEngine(model=args.embedding_model, num_threads=1).embed(texts)
        vectors = np.array([d.embedding for d in got.data], dtype=np.float32)
        np.testing.assert_allclose(vectors, reference.embeddings, atol=1e-5)


def replica_stats(deployment: str, app: str, num_replicas: int) -> list[dict]:
    """Stats of every replica of a deployment (its router picks replicas at random)."""
    handle = serve.get_deployment_handle(deployment, app_name=app)
    seen: dict[str, dict] = {}
    for _ in range(60):
        stats = handle.stats.remote().result(timeout_s=30)
        seen[stats["replica_id"]] = stats
        if len(seen) == num_replicas:
            return list(seen.values())
    raise AssertionError(f"saw {len(seen)} of {num_replicas} {deployment} replicas")


def wait_idle(app: str, details: dict[str, Any], timeout_s: float = 60.0) -> None:
    """Every engine replica empty, the PD router holding no KV, no image being encoded."""
    counts = {name: len(d["replicas"]) for name, d in details["deployments"].items()}
    deadline = time.monotonic() + timeout_s
    while True:
        busy = busy_engines(
            [
                stats
                for name in sorted(ENGINE_DEPLOYMENTS & set(counts))
                for stats in replica_stats(name, app, counts[name])
            ]
        )
        if "PDRouter" in counts:
            router = serve.get_deployment_handle("PDRouter", app_name=app)
            refs = sum(s.get("num_kv_refs_held", 0) for s in router.stats.remote().result())
            busy += [{"router_kv_refs": refs}] if refs else []
        if "VisionEncoder" in counts:
            encoders = replica_stats("VisionEncoder", app, counts["VisionEncoder"])
            busy += [s for s in encoders if s["num_pending"]]
        if not busy:
            return
        assert time.monotonic() < deadline, f"{app} not idle: {busy}"
        time.sleep(0.3)


# Every shipped Serve config by name, and how it is tested here: "deploy" files are deployed as
# written on the test cluster; the others ask for accelerators this machine does not have
# (neuron_cores, GPUs) and are checked only (schema, args against the models, accelerators).
SHIPPED = {
    "serve_config.yaml": "deploy",
    "configs/serve/colocated.yaml": "deploy",
    "configs/serve/epd.yaml": "deploy",
    "configs/serve/gpu.yaml": "check",
    "configs/serve/trn1.yaml": "check",
    "configs/serve/trn2.yaml": "check",
}


def test_every_shipped_config_is_named_and_tested() -> None:
    assert sorted(IDS) == sorted(SHIPPED)
    for name, how in SHIPPED.items():
        config = load(ROOT / name)
        accelerated = asks_for_neuron_cores(config) or "num_gpus: 1" in (ROOT / name).read_text()
        assert (how == "check") == accelerated, name
