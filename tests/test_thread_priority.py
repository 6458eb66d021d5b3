"""Serving threads behind the engine's: the nice values deployments/thread_priority.py sets,
read back from the kernel, and which threads of an engine replica keep the default."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from deployments.thread_priority import lower_priority, thread_ids

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's")


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def _alive_nice(tids: set[int]) -> list[int]:
    """The nice values of those of ``tids`` still running."""
    values = []
    for tid in tids:
        try:
            values.append(_nice(tid))
        except ProcessLookupError:
            continue
    return values


def _in_thread(fn):  # noqa: ANN001, ANN202 - runs fn on a thread of its own, returns its result
    out: dict = {}

    def run() -> None:
        out["tid"] = threading.get_native_id()
        out["value"] = fn()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out["tid"], out["value"]


def test_only_the_threads_named_are_raised_and_their_new_threads_inherit() -> None:
    here = _nice(threading.get_native_id())

    def raised_then_spawn() -> tuple[int, int, int]:
        me = threading.get_native_id()
        changed = lower_priority({me}, 3)
        _, inherited = _in_thread(lambda: _nice(threading.get_native_id()))  # made by me now
        return changed, _nice(me), inherited

    _, (changed, raised, inherited) = _in_thread(raised_then_spawn)
    assert changed == 1 and raised == here + 3 and inherited == here + 3
    assert _nice(threading.get_native_id()) == here  # the caller's own thread untouched


def test_a_value_is_never_lowered_and_19_is_the_cap() -> None:
    here = _nice(threading.get_native_id())

    def run() -> tuple[int, int, int]:
        me = threading.get_native_id()
        lower_priority({me}, 7)
        lowered = lower_priority({me}, 4, base=here)  # below its value now: left as it is
        assert lower_priority({me}, None) == 0  # None: as Ray set it
        seven = _nice(me)
        lower_priority({me}, 50)
        return lowered, seven, _nice(me)

    _, (lowered, seven, capped) = _in_thread(run)
    assert lowered == 0
    assert seven == min(19, here + 7) and capped == 19


def test_zero_steps_lifts_only_the_threads_ahead_of_the_base() -> None:
    """As in a Ray worker: threads at 0 beside Python threads at 15 are brought level."""
    here = _nice(threading.get_native_id())

    def run() -> tuple[int, int, int]:
        me = threading.get_native_id()
        changed_level = lower_priority({me}, 0, base=here)  # already level: nothing to do
        changed_ahead = lower_priority({me}, 0, base=here + 5)  # ahead of the base by 5
        return changed_level, changed_ahead, _nice(me)

    _, (level, lifted, nice) = _in_thread(run)
    assert level == 0 and lifted == 1 and nice == min(19, here + 5)


def test_an_engine_replica_raises_its_builder_thread_but_not_its_engines(
    tiny_llama_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built on a thread of its own (as Serve builds a replica on its event loop's thread),
    with the threads "there before" narrowed to that one (the test process's own stay as
    they are): it is raised once the replica is built, while the threads made during the
    build (the engine loop; the kernel pool's worker unless an earlier test made it) keep the
    default."""
    from deployments import engine_replica
    from deployments.llm_server import LLMServer

    monkeypatch.setattr(engine_replica, "thread_ids", lambda: {threading.get_native_id()})
    before = thread_ids()
    engine_args = {
        "model": str(tiny_llama_path),
        "max_model_len": 128,
        "num_kv_blocks": 16,
        "num_threads": 2,
    }
    here = _nice(threading.get_native_id())

    def build():  # noqa: ANN202
        server = LLMServer.func_or_class(engine_args, serving_threads_nice=here + 6)
        return server, _nice(threading.get_native_id())

    builder, (server, builder_nice) = _in_thread(build)
    try:
        assert builder_nice == here + 6
        assert _nice(server.engine._thread.native_id) == here
        # The other threads made meanwhile (the kernel pool's worker unless an earlier test
        # made it); /proc/self/task may not be listable late in a long run (file descriptors).
        made = thread_ids() - before - {builder}  # (it may linger a moment after its join)
        assert all(nice == here for nice in _alive_nice(made))
    finally:
        server.engine.shutdown()
