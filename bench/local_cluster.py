"""The local Ray cluster and Serve instance the serving benchmarks run their apps on.

Everything binds to 127.0.0.1: Ray's own listeners through RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
(read when ray is imported, so it is set here before that) and the node address, Serve's HTTP
proxy through its host. More logical CPUs than the machine's two, so that several small apps
fit; their replicas mostly wait.
"""

from __future__ import annotations

import os
import socket

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Workers at nice 0, as `make serve` starts them (deployments/thread_priority.py); Ray's
# config variables keep their lower-case names.
NICENESS_VAR = "RAY_worker_niceness"
DEFAULT_NICENESS = os.environ.setdefault(NICENESS_VAR, "0")
# The variables the running cluster was started with beyond this process's own.
_cluster_env: dict[str, str] = {}


def start_local_serve(
    num_cpus: int = 4, worker_niceness: int | None = None, env: dict[str, str] | None = None
) -> int:
    """Starts the cluster and Serve on a free port of 127.0.0.1; returns the port. Its workers
    run at ``worker_niceness`` (default: RAY_worker_niceness, 0 unless set), and every Ray
    process it starts (raylet, workers, Serve's controller) sees ``env`` on top of this
    process's environment."""
    import ray
    from ray import serve

    # Read by the raylet ray.init starts, which its workers inherit.
    os.environ[NICENESS_VAR] = DEFAULT_NICENESS if worker_niceness is None else str(worker_niceness)
    _cluster_env.update(env or {})
    os.environ.update(_cluster_env)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray.init(
        address="local",
        include_dashboard=False,
        num_cpus=num_cpus,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def stop_local_serve() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    for key in _cluster_env:
        os.environ.pop(key, None)
    _cluster_env.clear()
