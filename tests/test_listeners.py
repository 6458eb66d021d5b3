"""The warning at application build when Ray's node address is reachable from other hosts."""

from __future__ import annotations

import logging

import pytest
import ray

from app import builder
from app.builder import listener_warning


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.1.1", "::1", "localhost"])
def test_loopback_addresses_need_no_warning(address):
    assert listener_warning(address) is None


@pytest.mark.parametrize("address", ["10.0.3.7", "192.168.1.20", "0.0.0.0", "fe80::1", "my-host"])
def test_other_addresses_warn_naming_the_fix(address):
    warning = listener_warning(address)
    assert warning is not None
    assert warning.startswith(f"Ray's node address is {address}, not loopback: ")
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in warning
    assert "--dashboard-host 127.0.0.1" in warning
    assert "\n" not in warning


def build_warnings(monkeypatch, caplog, model, node_ip: str) -> list[str]:
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: node_ip)
    with caplog.at_level(logging.WARNING, logger=builder.__name__):
        builder.build_app({"model": str(model), "max_model_len": 256, "embedding_model": None})
    return [r.getMessage() for r in caplog.records if r.name == builder.__name__]


def test_build_app_logs_one_warning_off_loopback(monkeypatch, caplog, tiny_llama_path):
    assert build_warnings(monkeypatch, caplog, tiny_llama_path, "10.0.3.7") == [
        listener_warning("10.0.3.7")
    ]


def test_build_app_is_quiet_on_loopback(monkeypatch, caplog, tiny_llama_path):
    assert build_warnings(monkeypatch, caplog, tiny_llama_path, "127.0.0.1") == []
