"""Profiles of a replica's process on request: what the ingress's ``/start_profile`` and
``/stop_profile`` fan out to (app/profiling.py).

Engine replicas and vision encoders inherit ``ProfiledReplica``; each runs its backend's
profiler (neuron_runtime/accuracy/profiler.py: torch.profiler on cpu/cuda, torch_xla's on
xla/neuron) over every thread of its process, the engine loop and the encoder's tower threads
included. Both methods answer plain dicts; a start while a profile runs, or a stop without
one, is refused in the answer (``ok`` false), not raised, so the ingress can tell a client's
mistake from a replica's failure. Tensor-parallel ranks in other processes are not profiled.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from neuron_runtime.accuracy.profiler import Profiler

logger = logging.getLogger("ray.serve")


class ProfiledReplica:
    """``start_profile``/``stop_profile`` for a deployment class that sets ``replica_id`` and
    ``profile_backend`` (the device its model runs on)."""

    replica_id: str
    profile_backend: str = "cpu"
    _profiler: Profiler | None = None

    def _profile_answer(self, ok: bool, **fields: Any) -> dict[str, Any]:
        return {
            "deployment": type(self).__name__,
            "replica_id": self.replica_id,
            "backend": self.profile_backend,
            "ok": ok,
            **fields,
        }

    def start_profile(self, output_dir: str, row_limit: int = 20) -> dict[str, Any]:
        """Starts profiling this process; traces go under ``output_dir``/<class>-<replica>."""
        if self._profiler is not None:
            return self._profile_answer(False, error="a profile is already running")
        out = Path(output_dir) / f"{type(self).__name__}-{self.replica_id}"
        profiler = Profiler(self.profile_backend, out, row_limit)
        profiler.start()
        self._profiler = profiler
        return self._profile_answer(True, output_dir=str(out))

    def stop_profile(self) -> dict[str, Any]:
        """Stops the profile: the files written and the summary table of the top ops (also
        logged)."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return self._profile_answer(False, error="no profile is running")
        result = profiler.stop()
        logger.info(
            "profile of %s %s: %s\n%s",
            type(self).__name__,
            self.replica_id,
            ", ".join(map(str, result.files)),
            result.summary,
        )
        return self._profile_answer(
            True, files=[str(p) for p in result.files], summary=result.summary, notes=result.notes
        )
