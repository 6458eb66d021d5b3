"""Thread priorities in the serving processes: the engine's kernel threads first.

An engine replica's kernel threads fill the cores it was given, one parallel kernel call
after another, each call waiting for its slowest thread. Every other thread of the serving
path (Ray's and Serve's own threads, the replica's event loop, the ingress and PD router
processes) that wakes on those cores preempts a kernel thread, and the whole call waits for
it: on a 2-vCPU host the served engine made 0.70-0.73x the offline engine's tokens at
concurrency 16 while those threads took about a tenth of the CPU. With their nice value
raised (``serving_threads_nice``, 10 by default) they run on what the kernel threads leave
and preempt them less: +10-13% output tokens at concurrency 16 in the same runs
(bench/serve.py, README "Served throughput").

Only ever raised: an unprivileged process may not lower a nice value, so the threads that
must keep the default (the engine loop, the kernel pool, a KV transport's reader) are those
created before the raise, by a thread that still had it. Threads created later by a raised
thread inherit its value. Linux only (a per-thread nice, /proc/self/task); elsewhere nothing
changes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def thread_ids() -> set[int]:
    """The native ids of this process's threads now (empty where /proc is not there)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def lower_priority(threads: Iterable[int], nice: int) -> int:
    """Raises the nice value of each thread in ``threads`` to ``nice`` (one already at or above
    it is left as it is); how many were changed. 0 changes nothing."""
    if nice <= 0:
        return 0
    changed = 0
    for tid in threads:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except OSError:  # the thread ended meanwhile
            continue
    return changed
