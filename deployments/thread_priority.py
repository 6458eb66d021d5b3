"""Thread priorities in the serving processes: the engine's kernel threads first.

An engine replica's kernel threads fill the cores it was given, one parallel kernel call
after another, each call waiting for its slowest thread. Every other thread of the serving
path (Ray's and Serve's own threads, the replica's event loop, the ingress and PD router
processes) that wakes on those cores preempts a kernel thread, and the whole call waits for
it. Worse, Ray starts its workers at nice 15 (``worker_niceness``) while its daemons and the
C++ threads inside each worker (gRPC, I/O) stay at 0, so the kernel threads yield to all of
those. Here every such thread but the engine's is put ``serving_threads_nice`` steps (10 by
default) behind the engine's threads, at most at 19; clusters this project starts (the
Makefile, bench/, the KubeRay manifests) set ``RAY_worker_niceness=0``, so the engine runs at
0 and the rest at 10. bench/serve.py measures it (``-same-priority`` configs; README "Served
throughput").

Only ever raised: an unprivileged process may not lower a nice value, so the threads that
must keep the default (the engine loop, the kernel pool, a KV transport's reader) are those
created before the raise, by a thread that still had it. Threads created later by a raised
thread inherit its value. Linux only (a per-thread nice, /proc/self/task); elsewhere nothing
changes.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable

MAX_NICE = 19


def thread_ids() -> set[int]:
    """The native ids of this process's threads now (empty where /proc is not there)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def current_nice() -> int:
    """The calling thread's nice value (the value the threads it starts inherit); 0 off
    Linux."""
    if sys.platform != "linux":
        return 0
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def lower_priority(threads: Iterable[int], steps: int, base: int | None = None) -> int:
    """Raises the nice value of each thread in ``threads`` to ``steps`` above ``base`` (the
    engine's threads' value; by default the calling thread's), at most 19; one already at or
    above that is left as it is. How many were changed; ``steps`` 0 changes nothing."""
    if steps <= 0 or sys.platform != "linux":
        return 0
    target = min(MAX_NICE, (current_nice() if base is None else base) + steps)
    changed = 0
    for tid in threads:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
                changed += 1
        except OSError:  # the thread ended meanwhile
            continue
    return changed
