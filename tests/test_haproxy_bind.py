"""app/haproxy_bind.py: HAProxy's any-address listeners rebound to the HTTP frontend's address.

No cluster: the rewrite on config text shaped as Ray Serve writes it, and a check that Ray's
own template still binds its listeners in the forms the rewrite knows.
"""

from __future__ import annotations

import re

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
