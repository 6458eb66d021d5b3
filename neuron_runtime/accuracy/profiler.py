"""Profiles of an engine's work between ``start`` and ``stop``, per backend.

    cpu, cuda     torch.profiler (CPU activity, plus CUDA kernels on cuda): a Chrome trace
                  JSON (chrome://tracing, Perfetto) and a table of the top ops by self time
    xla, neuron   torch_xla's profiler (start_trace/stop_trace): an XPlane trace for
                  TensorBoard's profile plugin, and torch_xla's metrics (compiles, transfers,
                  execution times) as the table. On Neuron, device-level traces come from
                  the Neuron runtime itself, which reads NEURON_RT_INSPECT_ENABLE=1 and
                  NEURON_RT_INSPECT_OUTPUT_DIR when the replica starts; ``stop`` reports
                  whether they were set.

Device libraries are imported when a profile starts, as the backends do.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ProfileResult:
    """What ``stop`` wrote and its summary table."""

    backend: str
    files: list[Path]
    summary: str
    notes: list[str] = field(default_factory=list)


class TorchProfiler:
    """torch.profiler for the CPU and CUDA backends."""

    def __init__(self, backend: str, out_dir: str | Path, row_limit: int = 20) -> None:
        self.backend = backend
        self.out_dir = Path(out_dir)
        self.row_limit = row_limit
        self._profile: Any = None

    def start(self) -> None:
        from torch._C._profiler import _ExperimentalConfig
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.backend == "cuda":
            activities.append(ProfilerActivity.CUDA)
        # Every thread of the process: a served engine steps on its own loop thread, not on
        # the thread that starts the profile (which alone is recorded otherwise).
        self._profile = profile(
            activities=activities,
            record_shapes=True,
            experimental_config=_ExperimentalConfig(profile_all_threads=True),
        )
        self._profile.__enter__()

    def stop(self) -> ProfileResult:
        prof, self._profile = self._profile, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"trace-{time.strftime('%Y%m%d-%H%M%S')}-pid{os.getpid()}.json"
        prof.export_chrome_trace(str(path))
        sort_by = "self_cuda_time_total" if self.backend == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=self.row_limit)
        return ProfileResult(self.backend, [path], table)


class XLAProfiler:
    """torch_xla's profiler for the XLA and Neuron backends."""

    def __init__(self, backend: str, out_dir: str | Path, row_limit: int = 20) -> None:
        self.backend = backend
        self.out_dir = Path(out_dir)
        self.row_limit = row_limit
        self._before: set[Path] = set()

    def start(self) -> None:
        import torch_xla.debug.profiler as xp

        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._before = set(self.out_dir.rglob("*"))
        xp.start_trace(str(self.out_dir))

    def stop(self) -> ProfileResult:
        import torch_xla.debug.metrics as met
        import torch_xla.debug.profiler as xp

        xp.stop_trace()
        files = sorted(p for p in set(self.out_dir.rglob("*")) - self._before if p.is_file())
        lines = met.short_metrics_report().splitlines()
        notes = []
        if self.backend == "neuron":
            inspect = os.environ.get("NEURON_RT_INSPECT_ENABLE") == "1"
            where = os.environ.get("NEURON_RT_INSPECT_OUTPUT_DIR", "(unset)")
            notes.append(
                f"Neuron runtime device traces: {'on, in ' + where if inspect else 'off'} "
                "(NEURON_RT_INSPECT_ENABLE=1 and NEURON_RT_INSPECT_OUTPUT_DIR at replica start)"
            )
        return ProfileResult(self.backend, files, "\n".join(lines[: 4 * self.row_limit]), notes)


PROFILERS: dict[str, type[TorchProfiler] | type[XLAProfiler]] = {
    "cpu": TorchProfiler,
    "cuda": TorchProfiler,
    "xla": XLAProfiler,
    "neuron": XLAProfiler,
}


class Profiler:
    """One profile at a time of whatever this process runs, on ``backend``'s profiler.

    >>> profiler = Profiler("cpu", "/tmp/profiles")
    >>> profiler.start(); engine.step(); result = profiler.stop()
    """

    def __init__(self, backend: str, out_dir: str | Path, row_limit: int = 20) -> None:
        if backend not in PROFILERS:
            raise ValueError(
                f"no profiler for device {backend!r}; choose one of {sorted(PROFILERS)}"
            )
        if row_limit < 1:
            raise ValueError(f"row_limit must be >= 1, got {row_limit}")
        self._impl = PROFILERS[backend](backend, out_dir, row_limit)
        self.running = False

    def start(self) -> None:
        """Starts profiling; ValueError if a profile is already running."""
        if self.running:
            raise ValueError("a profile is already running; stop it first")
        self._impl.start()
        self.running = True

    def stop(self) -> ProfileResult:
        """Stops profiling and writes the trace; ValueError if none is running."""
        if not self.running:
            raise ValueError("no profile is running; start one first")
        self.running = False
        return self._impl.stop()
