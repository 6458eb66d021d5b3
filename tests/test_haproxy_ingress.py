"""Serve's HAProxy mode: `RAY_SERVE_ENABLE_HA_PROXY=1 make serve-colocated` as the README gives it.

HAProxy takes the HTTP port in place of Serve's Python proxy and passes each request to an
ingress replica's own HTTP server, so a streamed token goes from the ingress to the client
without a Ray message to the proxy. This starts `serve run configs/serve/colocated.yaml` in a
cluster of its own (a subprocess, beside the test session's cluster), changing only the HTTP
port and the ingress's drain period on shutdown, and checks through the openai client that
the streamed tokens are the offline engine's, that a bad request gets its 400, and that
HAProxy, not Serve's proxy, holds the port.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import yaml
from conftest import _free_port

from neuron_runtime import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "serve" / "colocated.yaml"
PROMPT = "The lighthouse keeper looked at the sea and"


def _stop(proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Ctrl-C, as a user stops `serve run` (it deletes the app and its cluster goes with it)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def haproxy_app(tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen]]:
    port = _free_port()
    config = yaml.safe_load(CONFIG.read_text())
    config["http_options"]["port"] = port
    path = tmp_path_factory.mktemp("haproxy") / "colocated.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {
        **os.environ,
        # What the Makefile exports for `make serve-colocated`, plus the mode itself.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_worker_niceness": "0",
        "OMP_NUM_THREADS": "1",
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        # Serve keeps a stopping ingress replica 30 s for load balancers to drop it.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    }
    env.pop("RAY_ADDRESS", None)
    log = path.with_suffix(".log").open("w")
    serve_bin = Path(sys.executable).parent / "serve"
    proc = subprocess.Popen(
        [str(serve_bin), "run", "--address", "local", str(path)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while True:
            assert proc.poll() is None, f"serve run exited: {path.with_suffix('.log').read_text()}"
            try:
                if httpx.get(f"{base}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the app did not answer within 420 s"
            time.sleep(2)
        yield base, proc
    finally:
        _stop(proc)
        log.close()


def _listeners() -> list:
    return [
        c for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.pid
    ]


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:  # ended meanwhile
        return ""


def _port_holders(port: int, timeout_s: float = 60.0) -> list[tuple[object, str, set[int]]]:
    """Each socket listening on `port`, with its process's name and the ids of its parents.

    Serve reloads HAProxy when the ingress replicas change: the new process takes the port and
    the old one finishes its connections and exits, so for a moment a listener's process may
    be gone. Read again until every listener on the port has a live process to read.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        holders = [c for c in _listeners() if c.laddr.port == port]
        try:
            read = []
            for c in holders:
                process = psutil.Process(c.pid)
                read.append((c, process.name(), {p.pid for p in process.parents()}))
            if read:
                return read
        except psutil.NoSuchProcess:
            pass
        assert time.monotonic() < deadline, f"no live process holds port {port}: {holders}"
        time.sleep(0.5)


def test_haproxy_holds_the_port_and_streams_the_engines_tokens(haproxy_app) -> None:
    base, proc = haproxy_app
    port = int(base.rsplit(":", 1)[1])
    for holder, name, parents in _port_holders(port):
        assert name == "haproxy" and holder.laddr.ip == "127.0.0.1", holder
        # HAProxy belongs to this app's cluster, started under `serve run`.
        assert proc.pid in parents
    listeners = _listeners()
    # The ingress replica's own HTTP server (Serve's direct-ingress port range), on 127.0.0.1.
    ingress = [
        c
        for c in listeners
        if 30000 <= c.laddr.port <= 31000 and "OpenAIIngress" in _cmdline(c.pid)
    ]
    assert ingress and all(c.laddr.ip == "127.0.0.1" for c in ingress), ingress

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    stream = client.completions.create(
        model="smollm2-135m-instruct",
        prompt=PROMPT,
        max_tokens=24,
        temperature=0.0,
        stream=True,
    )
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert len(chunks) >= 12  # streamed token by token, not in one piece

    reference = LLM(model="smollm2-135m-instruct", max_model_len=2048).generate(
        [PROMPT], SamplingParams(max_tokens=24, temperature=0.0)
    )[0]
    assert "".join(chunks) == reference.outputs[0].text


def test_a_bad_request_through_haproxy_gets_a_400_naming_the_field(haproxy_app) -> None:
    base, _ = haproxy_app
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, max_tokens=-1)
    assert "max_tokens" in str(info.value.body)
