"""``POST /start_profile`` and ``/stop_profile`` (app/profiling.py, deployments/profiling.py).

On the shared cluster: the disaggregated app over the tiny Llama with an API key. The test
starts a profile over HTTP, sends one chat through the OpenAI client, stops it, and reads what
every engine replica (prefill and decode) wrote: Chrome trace JSON files that parse and hold
the ops the engine ran on its loop thread (the thread that starts a profile is not the one
that steps the engine), and a summary table whose top op is in the trace. Mistakes (a second
start, a stop without a start) are 400s with the OpenAI error body; no key is a 401.
Without Ray: a vision encoder replica's profile of a batch encoded on a worker thread, and
where the traces go.
"""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.profiling import DEFAULT_PROFILER_DIR, PROFILER_DIR_VARIABLE, ProfilerConfig
from neuron_runtime.backends.cpu_decode import PROFILE_LABEL

API_KEY = "profile-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def trace_ops(path: str) -> set[str]:
    """The names of the op events in a Chrome trace file, and of the ranges code labels
    (``torch.profiler.record_function``)."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("cat") in ("cpu_op", "user_annotation")}


def top_op(summary: str) -> str:
    """The first op row of torch.profiler's key_averages table (sorted by self time)."""
    rows = [line for line in summary.splitlines() if line.strip() and not line.startswith("-")]
    return rows[1].strip().split("  ")[0]  # rows[0] is the header; names are right-aligned


# -- without Ray ------------------------------------------------------------------------------


def test_output_dir_from_config_then_variable_then_default(monkeypatch):
    monkeypatch.delenv(PROFILER_DIR_VARIABLE, raising=False)
    assert ProfilerConfig().directory() == DEFAULT_PROFILER_DIR
    monkeypatch.setenv(PROFILER_DIR_VARIABLE, "/data/profiles")
    assert ProfilerConfig().directory() == "/data/profiles"
    assert ProfilerConfig(output_dir="/mnt/p").directory() == "/mnt/p"
    with pytest.raises(ValueError, match="row_limit"):
        ProfilerConfig(row_limit=0)


def test_app_args_take_the_profiler_section():
    from pydantic import ValidationError

    from app.builder import BuildArgs

    args = BuildArgs(profiler={"output_dir": "/tmp/p", "row_limit": 5})
    assert args.profiler.model_dump() == {"output_dir": "/tmp/p", "row_limit": 5, "timeout_s": 120}
    with pytest.raises(ValidationError, match="row_limit"):
        BuildArgs(profiler={"row_limit": 0})
    with pytest.raises(ValidationError, match="dir"):
        BuildArgs(profiler={"dir": "/tmp/p"})


def test_vision_encoder_profiles_its_tower_threads(tiny_llava_path, tmp_path):
    from PIL import Image

    from deployments.vision_encoder import VisionEncoderServer

    server = VisionEncoderServer.func_or_class(str(tiny_llava_path))
    pixels = np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    assert not server.stop_profile()["ok"]
    started = server.start_profile(str(tmp_path))
    assert started["ok"] and started["deployment"] == "VisionEncoderServer"
    assert not server.start_profile(str(tmp_path))["ok"]  # one at a time
    # The tower runs on a worker thread, as the replica's batches do (asyncio.to_thread).
    worker = threading.Thread(target=server._encode_sync, args=([buffer.getvalue()],))
    worker.start()
    worker.join()
    stopped = server.stop_profile()
    assert stopped["ok"] and stopped["backend"] == "cpu"
    (path,) = stopped["files"]
    assert Path(path).parent == tmp_path / "VisionEncoderServer-local"
    ops = trace_ops(path)
    assert "aten::conv2d" in ops  # the CLIP patch embedding
    assert top_op(stopped["summary"]) in ops


# -- over HTTP on the disaggregated app ---------------------------------------------------------


@pytest.fixture(scope="module")
def profiled_pd(serve_cluster, tiny_llama_path, tmp_path_factory):
    from ray import serve

    from app.builder import BuildArgs, build_openai_app

    out = tmp_path_factory.mktemp("profiles")
    small = {"ray_actor_options": {"num_cpus": 0.05}}
    app = build_openai_app(
        BuildArgs(
            mode="disaggregated",
            model=str(tiny_llama_path),
            served_model_name="tiny",
            max_model_len=256,
            embedding_model=None,
            engine_args={"num_kv_blocks": 64},
            api_key=API_KEY,
            profiler={"output_dir": str(out), "row_limit": 10},
        ),
        prefill_options=small,
        decode_options=small,
        ingress_options=small,
    )
    serve.run(app, name="profiled", route_prefix="/profiled")
    try:
        yield f"{serve_cluster}/profiled", out
    finally:
        serve.delete("profiled")


def post(url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url, json={}, headers=headers if headers is not None else AUTH, timeout=120)


@pytest.mark.ray
def test_profile_every_engine_replica_over_http(profiled_pd):
    from conftest import busy_engines
    from ray import serve

    openai = pytest.importorskip("openai")
    base, out = profiled_pd

    response = post(f"{base}/stop_profile")
    assert response.status_code == 400, response.text
    assert "no profile is running" in response.json()["error"]["message"]
    assert post(f"{base}/start_profile", headers={}).status_code == 401
    assert post(f"{base}/stop_profile", headers={}).status_code == 401

    response = post(f"{base}/start_profile")
    assert response.status_code == 200, response.text
    started = response.json()
    assert started["output_dir"] == str(out)
    assert sorted(r["deployment"] for r in started["replicas"]) == ["DecodeServer", "PrefillServer"]
    response = post(f"{base}/start_profile")
    assert response.status_code == 400, response.text
    assert "already running" in response.json()["error"]["message"]

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    completion = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Name a river."}],
        max_tokens=4,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert completion.usage.completion_tokens == 4

    response = post(f"{base}/stop_profile")
    assert response.status_code == 200, response.text
    replicas = response.json()["replicas"]
    assert sorted(r["deployment"] for r in replicas) == ["DecodeServer", "PrefillServer"]
    for replica in replicas:
        (path,) = replica["files"]
        assert Path(path).parent == out / f"{replica['deployment']}-{replica['replica_id']}"
        # The engine's forward passes ran on its loop thread, and they are in the trace: the
        # modules' torch ops, or a decode step's one kernel call (backends/cpu_decode.py).
        ops = trace_ops(path)
        assert {"aten::embedding", "aten::linear", PROFILE_LABEL} & ops, replica["deployment"]
        assert top_op(replica["summary"]) in ops
    response = post(f"{base}/stop_profile")
    assert response.status_code == 400, response.text

    stats = [
        serve.get_deployment_handle(name, app_name="profiled").stats.remote().result()
        for name in ("PrefillServer", "DecodeServer")
    ]
    assert not busy_engines(stats)
