"""CPU seconds per process of a running local app with nothing to serve.

What Ray's daemons, Serve's controller and proxy, HAProxy and each replica take while the app
idles: on a 2-vCPU box that CPU comes out of the engine's kernel threads once a load starts
(bench/serve.py --offline-beside-idle measures what it costs the engine). Start the app first
(`make serve`, `make serve-colocated`), wait until it answers, then:

    python bench/idle_cpu.py --seconds 30

Every process whose command line names Ray, Serve or HAProxy is counted (this one excepted),
from /proc, over the same window.
"""

from __future__ import annotations

import argparse
import os
import time

import psutil

MARKERS = ("ray", "serve", "haproxy", "gcs_server", "raylet")


def _title(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return ""


def _cpu(proc: psutil.Process) -> float | None:
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--top", type=int, default=20, help="processes listed")
    args = parser.parse_args()

    me = os.getpid()
    procs = [
        p for p in psutil.process_iter() if p.pid != me and any(m in _title(p) for m in MARKERS)
    ]
    before = {p.pid: _cpu(p) for p in procs}
    time.sleep(args.seconds)
    used = []
    for proc in procs:
        start, end = before[proc.pid], _cpu(proc)
        if start is not None and end is not None:
            used.append((end - start, proc.pid, _title(proc)[:90]))
    used.sort(reverse=True)
    total = sum(u[0] for u in used)
    cores = psutil.cpu_count() or 1
    print(
        f"{len(used)} processes, {total:.2f} CPU s in {args.seconds:.0f} s "
        f"({100 * total / (args.seconds * cores):.1f}% of {cores} cores)"
    )
    for seconds, pid, title in used[: args.top]:
        print(f"{seconds:7.2f}  {pid:>7}  {title}")


if __name__ == "__main__":
    main()
