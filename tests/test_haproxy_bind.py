"""app/haproxy_bind.py: HAProxy's any-address listeners rebound to the HTTP frontend's address.

No cluster: the rewrite on config text shaped as Ray Serve writes it, a check that Ray's own
template still binds its listeners in the forms the rewrite knows, and the real HAProxy
started through the wrapper.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
from conftest import _free_port
from ray.serve._private.haproxy_templates import HAPROXY_CONFIG_TEMPLATE

from app.haproxy_bind import bind_to_frontend, frontend_host, rewrite_args

CONFIG = """global
    stats socket /tmp/haproxy-serve/x/admin.sock mode 666 level admin expose-fd listeners
frontend prometheus
    bind :9101
    mode http
frontend http_frontend
    bind {host}:8000
    mode http
frontend grpc_frontend
    bind {host}:9000 proto h2
backend default_backend
    server r1 127.0.0.1:30000 check
listen stats
  bind *:8404
  stats enable
"""


def binds(config: str) -> list[str]:
    return re.findall(r"^\s*bind\s+(\S+)", config, re.MULTILINE)


def test_listeners_on_every_interface_move_to_the_frontends_address() -> None:
    config = CONFIG.format(host="127.0.0.1")
    assert frontend_host(config) == "127.0.0.1"
    bound = bind_to_frontend(config)
    assert binds(bound) == ["127.0.0.1:9101", "127.0.0.1:8000", "127.0.0.1:9000", "127.0.0.1:8404"]
    # Nothing but the two bind lines changed.
    changed = [
        (a, b) for a, b in zip(config.splitlines(), bound.splitlines(), strict=True) if a != b
    ]
    assert changed == [
        ("    bind :9101", "    bind 127.0.0.1:9101"),
        ("  bind *:8404", "  bind 127.0.0.1:8404"),
    ]


def test_a_frontend_on_every_interface_leaves_the_config_as_it_is() -> None:
    for host in ("0.0.0.0", "*", "::"):
        config = CONFIG.format(host=host)
        assert bind_to_frontend(config) == config


def test_rays_template_binds_its_other_listeners_in_the_forms_rewritten() -> None:
    """Every bind in Ray's template names a host, or is one that `bind_to_frontend` moves."""
    hosts = re.findall(r"^\s*bind (.*?):\{\{ config\.\w+ \}\}", HAPROXY_CONFIG_TEMPLATE, re.M)
    assert len(hosts) == len(re.findall(r"^\s*bind ", HAPROXY_CONFIG_TEMPLATE, re.M))
    assert sorted(hosts) == [
        "",  # the Prometheus exporter
        "*",  # the stats page
        "{{ config.frontend_host }}",
        "{{ config.grpc_frontend_host }}",
    ]


def test_the_config_argument_is_replaced_by_its_rebound_copy(tmp_path) -> None:
    path = tmp_path / "haproxy.cfg"
    path.write_text(CONFIG.format(host="127.0.0.1"))
    args = ["-db", "-f", str(path), "-sf", "123", "-x", "/tmp/admin.sock"]
    out = rewrite_args(args)
    assert out == ["-db", "-f", f"{path}.bound", "-sf", "123", "-x", "/tmp/admin.sock"]
    assert (tmp_path / "haproxy.cfg.bound").read_text() == bind_to_frontend(path.read_text())
    assert path.read_text() == CONFIG.format(host="127.0.0.1")  # Serve's file is left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["haproxy.cfg", "haproxy.cfg.bound"]


MINIMAL = """global
defaults
    mode http
    timeout connect 1s
    timeout client 1s
    timeout server 1s
frontend http_frontend
    bind 127.0.0.1:{port}
    default_backend default_backend
backend default_backend
    server r1 127.0.0.1:1
listen stats
  bind *:{stats_port}
  stats enable
"""

# Starts neuron-serve-haproxy as Serve's HAProxy manager does, prints its pid, then waits.
PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.argv[1], "-db", "-f", sys.argv[2]])
print(child.pid, flush=True)
child.wait()
"""


def test_haproxy_listens_on_the_frontends_address_and_ends_with_its_parent(tmp_path) -> None:
    """The real HAProxy, through the wrapper: its stats listener on 127.0.0.1, and gone once
    the process that started it is killed (as a stopped cluster kills Serve's manager)."""
    port, stats_port = _free_port(), _free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(MINIMAL.format(port=port, stats_port=stats_port))
    wrapper = Path(sys.executable).parent / "neuron-serve-haproxy"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(wrapper), str(config)],
        stdout=subprocess.PIPE,
        text=True,
    )
    haproxy = psutil.Process(int(parent.stdout.readline()))
    try:
        deadline = time.monotonic() + 20
        while True:
            listening = {
                (c.laddr.ip, c.laddr.port)
                for c in haproxy.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN
            }
            if len(listening) == 2:
                break
            assert time.monotonic() < deadline, listening
            time.sleep(0.2)
        assert haproxy.name() == "haproxy"
        assert listening == {("127.0.0.1", port), ("127.0.0.1", stats_port)}
        parent.kill()
        parent.wait()
        haproxy.wait(timeout=10)  # psutil.TimeoutExpired if it outlived its parent
    finally:
        if haproxy.is_running():
            haproxy.kill()
        if parent.poll() is None:
            parent.kill()
