"""How the shipped Serve configs share CPUs: engine replicas size their kernel threads from
their allotment, the laptop default keeps both of its two cores busy and fits on them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from app.builder import BuildArgs

ROOT = Path(__file__).resolve().parents[1]
ENGINES = {"LLMServer", "PrefillServer", "DecodeServer"}


def deployments(path: Path) -> dict[str, dict]:
    config = yaml.safe_load((ROOT / path).read_text())
    return {d["name"]: d for d in config["applications"][0]["deployments"]}


def min_replicas(d: dict) -> int:
    return int(d.get("num_replicas") or d.get("autoscaling_config", {}).get("min_replicas", 1))


def test_engine_threads_are_not_forced_to_one():
    """Unset, the replica sizes num_threads (deployments/engine_replica.py); set, it is passed."""
    assert BuildArgs().full_engine_args()["num_threads"] is None
    assert BuildArgs(num_threads=3).full_engine_args()["num_threads"] == 3
    with pytest.raises(ValidationError, match="num_threads"):
        BuildArgs(num_threads=0)


@pytest.mark.parametrize(
    "path,busy",
    [("serve_config.yaml", "DecodeServer"), ("configs/serve/colocated.yaml", "LLMServer")],
)
def test_default_configs_fill_two_cores_and_fit_on_them(path, busy):
    found = deployments(Path(path))
    cpus = {name: d["ray_actor_options"]["num_cpus"] for name, d in found.items()}
    # The replica that runs all the time under load gets both cores of a 2-vCPU box.
    assert math.ceil(round(cpus[busy], 4)) == 2
    # Every other engine replica one thread: it borrows a core only while it computes.
    for name in ENGINES & set(found) - {busy}:
        assert math.ceil(round(cpus[name], 4)) == 1
    # One replica of everything fits a 2-vCPU Ray node, and the file can scale out beyond it.
    assert sum(cpus[name] * min_replicas(d) for name, d in found.items()) <= 2.0 + 1e-9
    assert found[busy]["autoscaling_config"]["max_replicas"] > 1
