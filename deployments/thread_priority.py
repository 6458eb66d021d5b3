"""Thread priorities in the serving processes: no thread ahead of the engine's.

An engine replica's kernel threads fill the cores it was given, one parallel kernel call
after another, each call waiting for its slowest thread; every other thread that wakes on
those cores preempts a kernel thread and the whole call waits for it. Ray starts its workers
(every Serve replica) at nice 15 (``worker_niceness``), while the C++ threads it started in
each worker before that (gRPC, I/O, the GCS client) and its daemons stay at 0: the engine's
threads, and the Python threads that feed them (the replica's event loop, the ingress, the
PD router), then yield to all of those. Measured side by side on 2 vCPUs (bench/serve.py,
README "Served throughput"):

- with workers at nice 0 (``RAY_worker_niceness=0``: the Makefile, bench/ and the KubeRay
  manifests start Ray so) and every thread at one priority, the served / offline ratio was
  the best of the runs (0.83x colocated, 0.64x disaggregated, against 0.72-0.80x and
  0.48-0.59x at Ray's 15);
- on a cluster left at 15, lifting the threads that outrank the engine's changed -2% / +5%
  (colocated / disaggregated, concurrency 16) lifted to its value, +9.5% / +17% lifted to 10;
- putting the serving threads behind the engine's lost 5-13% in both runs that tried it:
  the event loop that hands the engine its requests and passes its tokens on is on the
  critical path too.

So each serving replica raises every thread that outranks its engine's threads (or, in the
ingress and PD router, its own Python threads) to their value, plus ``serving_threads_nice``
(0 by default). Only ever raised: an unprivileged process may not lower a nice value, so the
threads that keep theirs (the engine loop, the kernel pool, a KV transport's reader) are
those created before the raise. Linux only (a per-thread nice, /proc/self/task); elsewhere
nothing changes.
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


def lower_priority(threads: Iterable[int], steps: int | None, base: int | None = None) -> int:
    """Raises the nice value of each thread in ``threads`` to ``steps`` above ``base`` (the
    engine's threads' value; by default the calling thread's), at most 19; one already at or
    above that is left as it is. How many were changed; ``steps`` None changes nothing."""
    if steps is None or steps < 0 or sys.platform != "linux":
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
