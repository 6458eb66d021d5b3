"""configs/kuberay/: every RayService manifest is valid, fits its cluster, and is rendered now.

- the manifest validates against KubeRay v1.7.0's RayService schema (a copy committed under
  configs/kuberay/schema/, checked equal to ../shared/schemas/ where that exists);
- its serveConfigV2 is the Serve config file as written (no drift: `python -m app.render_kuberay`
  renders the same text now) and passes app.config_check: Ray's ServeDeploySchema, no unknown
  key, args that fit the models, deployment names the application builds, accelerators that
  match engine_args.device; its autoscaling_policy loads through Serve's own policy loader;
- what the engine replicas ask for at their maxima (neuron_cores or GPUs, and CPUs) fits the
  accelerator worker group as Ray's KubeRay autoscaler reads it (its own group-spec parser).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")
from ray.autoscaler._private.kuberay.autoscaling_config import (  # noqa: E402
    _get_ray_resources_from_group_spec,
)
from ray.serve._private.autoscaling_state import _resolve_policy_callable  # noqa: E402
from ray.serve.config import AutoscalingPolicy  # noqa: E402

from app import render_kuberay  # noqa: E402
from app.builder import BuildArgs  # noqa: E402
from app.config_check import DEVICE_RESOURCES, ENGINE_DEPLOYMENTS, check_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "configs" / "kuberay" / "schema" / "rayservice-v1.7.0.schema.json"
SHARED_SCHEMA = ROOT.parent / "shared" / "schemas" / "rayservice-v1.7.0.schema.json"
TARGETS = sorted(render_kuberay.TARGETS)


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load(render_kuberay.TARGETS[name].manifest.read_text())


def test_every_manifest_file_is_a_target() -> None:
    files = sorted((ROOT / "configs" / "kuberay").glob("rayservice-*.yaml"))
    assert [f.name for f in files] == sorted(f"rayservice-{t}.yaml" for t in TARGETS)


def test_the_committed_schema_is_kuberays() -> None:
    if not SHARED_SCHEMA.exists():
        pytest.skip(f"{SHARED_SCHEMA} is not on this machine")
    assert json.loads(SCHEMA.read_text()) == json.loads(SHARED_SCHEMA.read_text())


@pytest.mark.parametrize("name", TARGETS)
def test_manifest_validates_against_the_rayservice_schema(name: str) -> None:
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    manifest = load(name)
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(manifest)]
    assert not errors, errors
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")


def test_the_schema_refuses_what_kuberay_refuses() -> None:
    """The validator is not vacuous: a misspelt group field and a bad quantity fail."""
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    manifest = load("trn1")
    manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["maxReplica"] = 2
    assert not validator.is_valid(manifest)
    manifest = load("trn1")
    neuron = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]
    neuron["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "lots"
    assert not validator.is_valid(manifest)


@pytest.mark.parametrize("name", TARGETS)
def test_serve_config_is_the_serve_file_and_rendered_now(name: str) -> None:
    target = render_kuberay.TARGETS[name]
    text = target.manifest.read_text()
    assert yaml.safe_load(text)["spec"]["serveConfigV2"] == target.serve_config.read_text()
    assert text == render_kuberay.render(target)


def test_check_flags_a_manifest_that_drifted(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(render_kuberay, "OUT_DIR", tmp_path)
    with pytest.raises(SystemExit, match="not rendered"):
        render_kuberay.main(["--check"])
    render_kuberay.main([])
    render_kuberay.main(["--check"])
    path = render_kuberay.TARGETS["gpu"].manifest
    path.write_text(path.read_text().replace("max_replicas: 6", "max_replicas: 7"))
    with pytest.raises(SystemExit, match="rayservice-gpu.yaml"):
        render_kuberay.main(["--check"])


@pytest.mark.parametrize("name", TARGETS)
def test_serve_config_v2_passes_the_config_check(name: str) -> None:
    serve_config = yaml.safe_load(load(name)["spec"]["serveConfigV2"])
    schema = check_config(serve_config)
    for app in schema.applications:
        if app.autoscaling_policy is None:
            continue
        unknown = set(app.autoscaling_policy) - set(AutoscalingPolicy.model_fields)
        assert not unknown, unknown
        policy = _resolve_policy_callable(AutoscalingPolicy(**app.autoscaling_policy))
        for key, value in app.autoscaling_policy.get("policy_kwargs", {}).items():
            assert getattr(policy, key) == value


def replica_demand(serve_config: dict[str, Any]) -> dict[str, float]:
    """Every engine replica at its maximum: resources asked of the accelerator nodes."""
    total: dict[str, float] = {}
    for app in serve_config["applications"]:
        for d in app["deployments"]:
            if d["name"] not in ENGINE_DEPLOYMENTS:
                continue
            options = d["ray_actor_options"]
            asked = {"CPU": options.get("num_cpus", 1), **options.get("resources", {})}
            if options.get("num_gpus"):
                asked["GPU"] = options["num_gpus"]
            count = d.get("num_replicas") or d["autoscaling_config"]["max_replicas"]
            for key, amount in asked.items():
                total[key] = total.get(key, 0) + amount * count
    return total


@pytest.mark.parametrize("name", TARGETS)
def test_engine_replicas_at_their_maxima_fit_the_accelerator_group(name: str) -> None:
    manifest = load(name)
    cluster = manifest["spec"]["rayClusterConfig"]
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    demand = replica_demand(serve_config)
    accelerator = {r for r in DEVICE_RESOURCES.values() if r in demand}
    assert len(accelerator) == 1, demand
    (resource,) = accelerator
    groups = [
        (g, _get_ray_resources_from_group_spec(g, is_head=False))
        for g in cluster["workerGroupSpecs"]
    ]
    holders = [(g, r) for g, r in groups if r.get(resource, 0) > 0]
    assert len(holders) == 1, f"one worker group holds {resource}"
    group, per_node = holders[0]
    for key, amount in demand.items():
        assert amount <= per_node[key] * group["maxReplicas"], (key, amount, per_node)
    # Nothing else holds the accelerator: the head and CPU group declare none, and the head
    # takes no replica at all.
    head = _get_ray_resources_from_group_spec(cluster["headGroupSpec"], is_head=True)
    assert head["CPU"] == 0 and resource not in head
    assert cluster["enableInTreeAutoscaling"] is True


@pytest.mark.parametrize("name", TARGETS)
def test_accelerator_pods_land_on_their_nodes_with_a_shared_compile_cache(name: str) -> None:
    target = render_kuberay.TARGETS[name]
    acc = target.accelerator
    cluster = load(name)["spec"]["rayClusterConfig"]
    (group,) = [g for g in cluster["workerGroupSpecs"] if g["groupName"] == acc.group_name]
    pod = group["template"]["spec"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": acc.instance_type}
    assert {"key": acc.taint_key, "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    (container,) = pod["containers"]
    for device, count in acc.device_limits.items():
        assert container["resources"]["limits"][device] == count
    env = {e["name"]: e["value"] for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert env[acc.cache_env] == mounts["compile-cache"]
    claim = yaml.safe_load((ROOT / "configs" / "kuberay" / "compile-cache-pvc.yaml").read_text())
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert (
        volumes["compile-cache"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    )
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    if name.startswith("trn"):
        assert group["resources"]["neuron_cores"] == str(acc.ray_resources["neuron_cores"])


# EFA interfaces per instance type (AWS's published instance specifications).
EFA_INTERFACES = {"trn1.32xlarge": 8, "trn2.48xlarge": 16}


@pytest.mark.parametrize("name", TARGETS)
def test_trainium_pods_take_their_nodes_efa_for_nixl_libfabric(name: str) -> None:
    """KV between prefill and decode pods goes over EFA: the accelerator pods ask the EFA
    device plugin for every interface of their node, set libfabric's EFA provider, and the
    Serve config's disaggregated apps move KV with NIXL's LIBFABRIC backend."""
    acc = render_kuberay.TARGETS[name].accelerator
    manifest = load(name)
    cluster = manifest["spec"]["rayClusterConfig"]
    containers = {
        group.get("groupName", "head"): group["template"]["spec"]["containers"][0]
        for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    }
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    pd_apps = [BuildArgs(**a["args"]) for a in serve_config["applications"]]
    pd_apps = [a for a in pd_apps if a.mode == "disaggregated"]
    efa = "vpc.amazonaws.com/efa"
    for group, container in containers.items():
        resources = container["resources"]
        env = {e["name"]: e["value"] for e in container["env"]}
        if group != acc.group_name or acc.instance_type not in EFA_INTERFACES:
            assert efa not in resources["limits"] and "FI_PROVIDER" not in env, group
            continue
        count = EFA_INTERFACES[acc.instance_type]
        # Extended resources: requests equal to limits, or Kubernetes refuses the pod.
        assert resources["limits"][efa] == resources["requests"][efa] == count
        assert env["FI_PROVIDER"] == "efa"
        assert env["FI_EFA_USE_DEVICE_RDMA"] == "1"
        assert env["FI_EFA_FORK_SAFE"] == "1"
        assert pd_apps, "the Trainium config has disaggregated apps"
        for args in pd_apps:
            assert args.disaggregation.kv_transport == "nixl"
            assert args.disaggregation.kv_nixl_backend == "LIBFABRIC"


@pytest.mark.parametrize("name", TARGETS)
def test_every_ray_node_exports_metrics_and_the_dashboard_reads_prometheus(name: str) -> None:
    cluster = load(name)["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    for group in [head, *cluster["workerGroupSpecs"]]:
        port = int(group["rayStartParams"]["metrics-export-port"])
        (container,) = group["template"]["spec"]["containers"]
        assert {"containerPort": port, "name": "metrics"} in container["ports"]
    (container,) = head["template"]["spec"]["containers"]
    env = {e["name"] for e in container["env"]}
    assert {"RAY_PROMETHEUS_HOST", "RAY_GRAFANA_HOST", "RAY_GRAFANA_IFRAME_HOST"} <= env


def test_the_shipped_manifests_by_name() -> None:
    """rayservice-trn1.yaml, rayservice-trn2.yaml and rayservice-gpu.yaml, each rendered from
    its Serve config (configs/serve/trn1.yaml, trn2.yaml, gpu.yaml); a RayService needs a
    Kubernetes cluster with those nodes, so here they are validated, not deployed."""
    names = {t: render_kuberay.TARGETS[t].manifest.name for t in TARGETS}
    assert sorted(names.values()) == [
        "rayservice-gpu.yaml",
        "rayservice-trn1.yaml",
        "rayservice-trn2.yaml",
    ]
    for target in TARGETS:
        assert load(target)["kind"] == "RayService"


@pytest.mark.parametrize("name", TARGETS)
def test_every_ray_node_starts_its_workers_at_nice_0(name: str) -> None:
    """Ray's default (15) would put the engines' kernel threads behind Ray's own daemons and
    the C++ threads of every worker (deployments/thread_priority.py)."""
    cluster = load(name)["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        (container,) = group["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["RAY_worker_niceness"] == "0"
