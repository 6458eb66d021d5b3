"""`make serve` (and `make serve-colocated`) as the README gives them: Serve's HAProxy mode.

HAProxy takes the HTTP port in place of Serve's Python proxy and passes each request to an
ingress replica's own HTTP server, so a streamed token goes from the ingress to the client
without a Ray message to the proxy. This runs `make serve SERVE_CONFIG=<file>` on
serve_config.yaml (prefill/decode, the main job) and configs/serve/colocated.yaml, each in a
cluster of its own (a subprocess, beside the test session's cluster), changing only the HTTP
port. It checks that HAProxy, not Serve's proxy, holds the port, that every listener HAProxy
opens (the HTTP port, its stats page, its Prometheus exporter) is on 127.0.0.1
(app/haproxy_bind.py), that the streamed tokens through the openai client are the offline
engine's, that a bad request gets its 400, and that a client leaving mid-stream frees the
engine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
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
CONFIGS = {"pd": ROOT / "serve_config.yaml", "colocated": ROOT / "configs/serve/colocated.yaml"}
PROMPT = "The lighthouse keeper looked at the sea and"
MODEL = "smollm2-135m-instruct"

pytestmark = pytest.mark.ray


def _stop(proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Ctrl-C to make and `serve run` (it deletes the app and its cluster goes with it)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def haproxy_app(request, tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen, str]]:
    port = _free_port()
    config = yaml.safe_load(CONFIGS[request.param].read_text())
    config["http_options"]["port"] = port
    path = tmp_path_factory.mktemp("haproxy") / f"{request.param}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    log = path.with_suffix(".log").open("w")
    proc = subprocess.Popen(
        ["make", "-s", "serve", f"SERVE_CONFIG={path}"],
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
            assert proc.poll() is None, f"make serve exited: {path.with_suffix('.log').read_text()}"
            try:
                if httpx.get(f"{base}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the app did not answer within 420 s"
            time.sleep(2)
        yield base, proc, request.param
    finally:
        _stop(proc)
        log.close()
    _assert_port_released(port)


def _listeners() -> list:
    return [
        c for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.pid
    ]


def _name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:  # ended meanwhile
        return ""


def _started_by(pid: int, ancestor: int) -> bool:
    try:
        return ancestor in {p.pid for p in psutil.Process(pid).parents()}
    except psutil.Error:
        return False


def _haproxy_listeners_on_loopback(ancestor: int, timeout_s: float = 60.0) -> None:
    """Every listener of the HAProxy processes under `ancestor` is on 127.0.0.1, read until
    its three ports (HTTP, stats, exporter) are seen: a reload hands them from one process to
    the next, which may be gone or not yet listening at the moment of a read."""
    deadline = time.monotonic() + timeout_s
    while True:
        ours = [
            c for c in _listeners() if _name(c.pid) == "haproxy" and _started_by(c.pid, ancestor)
        ]
        assert all(c.laddr.ip == "127.0.0.1" for c in ours), ours
        if len({c.laddr.port for c in ours}) >= 3:
            return
        assert time.monotonic() < deadline, f"HAProxy's listeners under {ancestor}: {ours}"
        time.sleep(0.5)


def _assert_port_released(port: int, timeout_s: float = 30.0) -> None:
    """Nothing the app started holds its port once `make serve` has ended: an HAProxy started
    by a reload while the cluster stopped used to. A holder left is killed, then reported."""
    deadline = time.monotonic() + timeout_s
    while holders := [c for c in _listeners() if c.laddr.port == port]:
        if time.monotonic() > deadline:
            for c in holders:
                with contextlib.suppress(psutil.Error):
                    psutil.Process(c.pid).kill()
            raise AssertionError(f"port {port} still held after make serve ended: {holders}")
        time.sleep(0.5)


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
    base, proc, _ = haproxy_app
    port = int(base.rsplit(":", 1)[1])
    for holder, name, parents in _port_holders(port):
        assert name == "haproxy" and holder.laddr.ip == "127.0.0.1", holder
        # HAProxy belongs to this app's cluster, started under `make serve`.
        assert proc.pid in parents
    # Its stats page and Prometheus exporter too: Ray's config binds them on every interface.
    _haproxy_listeners_on_loopback(proc.pid)
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
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0.0,
        stream=True,
    )
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert len(chunks) >= 12  # streamed token by token, not in one piece

    reference = LLM(model=MODEL, max_model_len=2048).generate(
        [PROMPT], SamplingParams(max_tokens=24, temperature=0.0)
    )[0]
    assert "".join(chunks) == reference.outputs[0].text


def test_a_bad_request_through_haproxy_gets_a_400_naming_the_field(haproxy_app) -> None:
    base, _, _ = haproxy_app
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-1)
    assert "max_tokens" in str(info.value.body)


def _metric(base: str, name: str) -> float:
    """The sum of a metric's samples on /metrics (one per model name)."""
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name + "{")
    )


def _wait_metric(base: str, name: str, expected: float, failure: str) -> None:
    """Asks /metrics until `name` reads `expected`. A scrape whose stats call to the engine
    replicas times out (2 s) serves the last numbers seen, so one stale answer is not the
    answer."""
    deadline = time.monotonic() + 30
    while (value := _metric(base, name)) != expected:
        assert time.monotonic() < deadline, f"{failure} ({name} = {value})"
        time.sleep(0.5)


def test_a_client_leaving_mid_stream_frees_the_engine(haproxy_app) -> None:
    """HAProxy closes the ingress's connection; the ingress aborts the engine's request.

    /metrics reads the engine replicas' stats live: the LLMServer's, or (PD) every prefill
    and decode replica's through the router. The request asks for far more tokens than the
    client reads, so the engine counting it aborted (not finished) is the client's leaving
    reaching it, and no request left running is the engine letting go.
    """
    base, _, _ = haproxy_app
    aborted = _metric(base, "neuron:requests_aborted_total")
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{base}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        # One iterator, kept open: leaving a `for` over iter_lines() closes the connection.
        lines = response.iter_lines()
        events = 0
        while events < 8:
            events += next(lines).startswith("data: ")
        _wait_metric(base, "vllm:num_requests_running", 1, "/metrics never showed the request")
        # Closing the response here, 8 tokens of 2000 read, is the client leaving.
    _wait_metric(
        base, "neuron:requests_aborted_total", aborted + 1, "the engine never aborted the request"
    )
    _wait_metric(base, "vllm:num_requests_running", 0, "the engine still runs the request")
