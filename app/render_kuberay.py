"""Renders the KubeRay RayService manifests under configs/kuberay/ from the Serve configs.

``serveConfigV2`` of each manifest is its Serve config file, text for text (comments included):
the Serve config is the only copy that is edited, and ``python -m app.render_kuberay``
(``make kuberay``) writes the manifests again; ``--check`` exits non-zero when a committed
manifest differs from what the command renders now. The cluster around it comes from
``TARGETS`` below:

- the head runs the GCS, the dashboard and the autoscaler, and no replica (num-cpus 0);
- a CPU worker group for the ingress, the routers, the embedding model and vision encoders;
- an accelerator worker group: on Trainium it asks Kubernetes for the node's Neuron devices
  (``aws.amazon.com/neuron``, with the device plugin's taint tolerated) and declares the
  node's NeuronCores to Ray as ``neuron_cores`` in the group's ``resources`` map (KubeRay
  v1.7; the Ray autoscaler reads custom resources from there, pod limits name devices, not
  cores); on GPU nodes KubeRay derives the GPU count from ``nvidia.com/gpu``;
- on Trainium the accelerator pods also take every EFA interface of their node
  (``vpc.amazonaws.com/efa``, from the EFA device plugin) and the libfabric settings of
  ``EFA_ENV``: the Trainium Serve configs move KV between prefill and decode replicas with
  NIXL's LIBFABRIC backend, RDMA over EFA;
- ``enableInTreeAutoscaling``: Serve's replica demand adds and removes worker pods;
- every Ray node exports metrics on port 8080 (the ``metrics`` container port a PodMonitor
  scrapes), and the head's dashboard reads Prometheus and Grafana (RAY_PROMETHEUS_HOST,
  RAY_GRAFANA_*);
- the compiled graphs (neuronx-cc's NEURON_COMPILE_CACHE_URL, inductor's cache on GPU) live on a
  shared ReadWriteMany volume (configs/kuberay/compile-cache-pvc.yaml), so only a model's
  first start on the cluster compiles.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "configs" / "kuberay"
RAY_VERSION = "2.60.0"
DEFAULT_IMAGE = "neuron-serve:latest"
METRICS_PORT = 8080
CACHE_MOUNT = "/mnt/compile-cache"
CACHE_CLAIM = "neuron-serve-compile-cache"
# kube-prometheus-stack installed as release "prometheus" in namespace prometheus-system
# (docs/eks.md); the dashboard queries Prometheus from inside the cluster and embeds Grafana
# panels through the browser's port-forward.
DASHBOARD_ENV = {
    "RAY_PROMETHEUS_HOST": "http://prometheus-kube-prometheus-prometheus.prometheus-system.svc:9090",
    "RAY_PROMETHEUS_NAME": "Prometheus",
    "RAY_GRAFANA_HOST": "http://prometheus-grafana.prometheus-system.svc:80",
    "RAY_GRAFANA_IFRAME_HOST": "http://127.0.0.1:3000",
}
# Ray starts its workers (every Serve replica) at nice 15 while its own daemons and the C++
# threads inside each worker stay at 0; at 0 the engines' kernel threads no longer yield to
# those, and the serving threads are put behind them instead (deployments/thread_priority.py).
SCHEDULING_ENV = {"RAY_worker_niceness": "0"}
EFA_RESOURCE = "vpc.amazonaws.com/efa"
# libfabric's EFA provider as NIXL's LIBFABRIC backend uses it inside a Ray worker pod.
EFA_ENV = {
    # Only the EFA provider: a pod without its interfaces fails instead of falling back to TCP.
    "FI_PROVIDER": "efa",
    # RDMA reads straight from the remote side's registered memory (trn1/trn2 support it).
    "FI_EFA_USE_DEVICE_RDMA": "1",
    # A replica may fork (compile workers, subprocesses) after its KV cache is registered:
    # keep registered pages out of the child, and take libfabric's bounce buffers from normal
    # pages (huge-page buffers make fork fail with ENOMEM).
    "FI_EFA_FORK_SAFE": "1",
    "FI_EFA_USE_HUGE_PAGE": "0",
}


@dataclass(frozen=True)
class AcceleratorGroup:
    """The worker group whose nodes hold the engine replicas."""

    group_name: str
    instance_type: str
    cpu: int  # Kubernetes CPU request/limit of the Ray container (Ray's num-cpus)
    memory: str
    device_limits: dict[str, int]  # Kubernetes extended resources: the node's devices
    taint_key: str
    ray_resources: dict[str, int] = field(default_factory=dict)  # the group's `resources` map
    efa_interfaces: int = 0  # EFA interfaces of the instance type, all taken by the pod
    max_nodes: int = 1
    cache_env: str = "NEURON_COMPILE_CACHE_URL"
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Target:
    name: str
    serve_config: Path
    accelerator: AcceleratorGroup
    cpu_max_nodes: int = 4

    @property
    def manifest(self) -> Path:
        return OUT_DIR / f"rayservice-{self.name}.yaml"


TARGETS = {
    t.name: t
    for t in (
        Target(
            "trn1",
            ROOT / "configs" / "serve" / "trn1.yaml",
            # trn1.32xlarge: 16 Trainium chips = 32 NeuronCores, 128 vCPUs, 512 GiB, 8 EFA
            # interfaces (800 Gbps).
            AcceleratorGroup(
                group_name="neuron",
                instance_type="trn1.32xlarge",
                cpu=120,
                memory="480Gi",
                device_limits={"aws.amazon.com/neuron": 16},
                taint_key="aws.amazon.com/neuron",
                ray_resources={"neuron_cores": 32},
                efa_interfaces=8,
            ),
        ),
        Target(
            "trn2",
            ROOT / "configs" / "serve" / "trn2.yaml",
            # trn2.48xlarge: 16 Trainium2 chips = 64 logical NeuronCores at LNC=2, 192 vCPUs,
            # 2 TiB, 16 EFA interfaces (EFAv3, 3.2 Tbps).
            AcceleratorGroup(
                group_name="neuron",
                instance_type="trn2.48xlarge",
                cpu=184,
                memory="1900Gi",
                device_limits={"aws.amazon.com/neuron": 16},
                taint_key="aws.amazon.com/neuron",
                ray_resources={"neuron_cores": 64},
                efa_interfaces=16,
                env={"NEURON_LOGICAL_NC_CONFIG": "2"},
            ),
        ),
        Target(
            "gpu",
            ROOT / "configs" / "serve" / "gpu.yaml",
            # g6e.12xlarge: 4 NVIDIA L40S, 48 vCPUs, 384 GiB; two nodes at most.
            AcceleratorGroup(
                group_name="gpu",
                instance_type="g6e.12xlarge",
                cpu=44,
                memory="360Gi",
                device_limits={"nvidia.com/gpu": 4},
                taint_key="nvidia.com/gpu",
                max_nodes=2,
                cache_env="TORCHINDUCTOR_CACHE_DIR",
            ),
        ),
    )
}


def _env(values: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in values.items()]


def _container(
    name: str, image: str, cpu: int, memory: str, limits: dict[str, int], env: dict[str, str]
) -> dict[str, Any]:
    ports = [{"containerPort": METRICS_PORT, "name": "metrics"}]
    if name == "ray-head":
        ports = [
            {"containerPort": 6379, "name": "gcs-server"},
            {"containerPort": 8265, "name": "dashboard"},
            {"containerPort": 10001, "name": "client"},
            {"containerPort": 8000, "name": "serve"},
            *ports,
        ]
    else:
        ports = [{"containerPort": 8000, "name": "serve"}, *ports]
    requests: dict[str, Any] = {"cpu": str(cpu), "memory": memory, **limits}
    return {
        "name": name,
        "image": image,
        "ports": ports,
        "env": _env(env),
        "resources": {"requests": requests, "limits": dict(requests)},
        "volumeMounts": [{"name": "compile-cache", "mountPath": CACHE_MOUNT}],
    }


def _pod(container: dict[str, Any], node_pool: dict[str, str], taint: str | None) -> dict:
    spec: dict[str, Any] = {
        "containers": [container],
        "nodeSelector": node_pool,
        "volumes": [{"name": "compile-cache", "persistentVolumeClaim": {"claimName": CACHE_CLAIM}}],
    }
    if taint is not None:
        spec["tolerations"] = [{"key": taint, "operator": "Exists", "effect": "NoSchedule"}]
    return {"spec": spec}


def manifest(target: Target, image: str = DEFAULT_IMAGE) -> dict[str, Any]:
    """The RayService without serveConfigV2 (render() adds it as the file's text)."""
    acc = target.accelerator
    cache_env = {acc.cache_env: CACHE_MOUNT, **SCHEDULING_ENV}
    metrics = {"metrics-export-port": str(METRICS_PORT)}
    head = _container("ray-head", image, 4, "16Gi", {}, {**DASHBOARD_ENV, **cache_env})
    cpu_worker = _container("ray-worker", image, 16, "64Gi", {}, cache_env)
    devices, acc_env = dict(acc.device_limits), {**cache_env, **acc.env}
    if acc.efa_interfaces:
        devices[EFA_RESOURCE] = acc.efa_interfaces
        acc_env.update(EFA_ENV)
    acc_worker = _container("ray-worker", image, acc.cpu, acc.memory, devices, acc_env)
    acc_group: dict[str, Any] = {
        "groupName": acc.group_name,
        "replicas": 1,
        "minReplicas": 1,
        "maxReplicas": acc.max_nodes,
        "rayStartParams": dict(metrics),
    }
    if acc.ray_resources:
        acc_group["resources"] = {k: str(v) for k, v in acc.ray_resources.items()}
    acc_group["template"] = _pod(
        acc_worker, {"node.kubernetes.io/instance-type": acc.instance_type}, acc.taint_key
    )
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": f"neuron-serve-{target.name}"},
        "spec": {
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"upscalingMode": "Default", "idleTimeoutSeconds": 300},
                "headGroupSpec": {
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0", **metrics},
                    "template": _pod(head, {"karpenter.sh/nodepool": "ray-cpu"}, None),
                },
                "workerGroupSpecs": [
                    {
                        "groupName": "cpu",
                        "replicas": 1,
                        "minReplicas": 1,
                        "maxReplicas": target.cpu_max_nodes,
                        "rayStartParams": dict(metrics),
                        "template": _pod(cpu_worker, {"karpenter.sh/nodepool": "ray-cpu"}, None),
                    },
                    acc_group,
                ],
            },
        },
    }


def render(target: Target, image: str = DEFAULT_IMAGE) -> str:
    """The manifest's text: the cluster, then serveConfigV2 as a literal block holding the Serve
    config file unchanged."""
    source = target.serve_config.read_text()
    if not source.endswith("\n") or source.endswith("\n\n"):
        raise ValueError(f"{target.serve_config}: must end with exactly one newline")
    header = (
        f"# Generated by `python -m app.render_kuberay` (`make kuberay`) from "
        f"{target.serve_config.relative_to(ROOT)}:\n"
        "# edit that file (serveConfigV2) or app/render_kuberay.py (the cluster), then render.\n"
    )
    body = yaml.safe_dump(manifest(target, image), sort_keys=False, width=100)
    block = "".join(f"    {line}" if line.strip() else "\n" for line in source.splitlines(True))
    return f"{header}{body}  serveConfigV2: |\n{block}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help=f"any of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="the service's container image")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a manifest differs from its rendering"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.targets) - set(TARGETS))
    if unknown:
        parser.error(f"unknown target {unknown[0]!r} (targets: {', '.join(TARGETS)})")
    stale = []
    for name in args.targets or TARGETS:
        target = TARGETS[name]
        text = render(target, args.image)
        path = target.manifest
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(os.path.relpath(path, ROOT))
            continue
        path.write_text(text)
        print(f"wrote {os.path.relpath(path, ROOT)}")
    if stale:
        sys.exit(
            f"error: not rendered from their Serve configs: {', '.join(stale)} (run make kuberay)"
        )


if __name__ == "__main__":
    main()
