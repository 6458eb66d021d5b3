"""``POST /start_profile`` and ``POST /stop_profile``: profile every engine replica of the app.

The ingress broadcasts to every running replica of the app's engine deployments (LLMServer,
PrefillServer, DecodeServer, VisionEncoder); each profiles its own process
(deployments/profiling.py). The traces go to ``output_dir`` on each replica's node, one folder
per replica; stop answers, per replica, the files written and the top-ops table.

A start while a profile runs, or a stop without one, is a client's mistake: 400 with the
OpenAI error body. A replica that fails or does not answer in time makes it a 503 naming it.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from ray import serve

from app.errors import OpenAIError

# Serve deployment names whose replicas own an engine or a vision tower.
PROFILED_DEPLOYMENTS = ("LLMServer", "PrefillServer", "DecodeServer", "VisionEncoder")
PROFILER_DIR_VARIABLE = "NEURON_SERVE_PROFILER_DIR"
DEFAULT_PROFILER_DIR = "/tmp/neuron-serve/profiles"


@dataclass(frozen=True)
class ProfilerConfig:
    """Where traces go (``profiler.output_dir`` in the app's args, else $NEURON_SERVE_PROFILER_DIR,
    else /tmp/neuron-serve/profiles) and how many ops the summary table lists."""

    output_dir: str | None = None
    row_limit: int = 20
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.row_limit < 1:
            raise ValueError(f"profiler.row_limit must be >= 1, got {self.row_limit}")
        if self.timeout_s <= 0:
            raise ValueError(f"profiler.timeout_s must be > 0, got {self.timeout_s}")

    def directory(self) -> str:
        return self.output_dir or os.environ.get(PROFILER_DIR_VARIABLE) or DEFAULT_PROFILER_DIR


class ProfileControl:
    """The ingress's side: fans start and stop out to the app's engine replicas."""

    def __init__(self, config: ProfilerConfig) -> None:
        self.config = config

    async def start(self) -> dict[str, Any]:
        output_dir = self.config.directory()
        answers = await self._broadcast("start_profile", output_dir, self.config.row_limit)
        refused = [a for a in answers if not a["ok"]]
        if refused:
            raise OpenAIError(
                400,
                "a profile is already running on "
                + ", ".join(f"{a['deployment']} {a['replica_id']}" for a in refused)
                + "; POST /stop_profile first",
            )
        return {"output_dir": output_dir, "replicas": answers}

    async def stop(self) -> dict[str, Any]:
        answers = await self._broadcast("stop_profile")
        stopped = [a for a in answers if a["ok"]]
        if not stopped:
            raise OpenAIError(400, "no profile is running; POST /start_profile first")
        return {"replicas": stopped}

    async def _broadcast(self, method: str, *args: Any) -> list[dict[str, Any]]:
        """Every profiled replica's answer; 503 when none answered or a call failed without
        a replica answering."""
        app_name = serve.get_replica_context().app_name
        status = await asyncio.to_thread(serve.status)
        names = [n for n in status.applications[app_name].deployments if n in PROFILED_DEPLOYMENTS]
        calls = [
            serve.get_deployment_handle(name, app_name=app_name)
            .broadcast(method, *args)
            .results_async(timeout_s=self.config.timeout_s, return_exceptions=True)
            for name in names
        ]
        try:
            per_deployment = await asyncio.gather(*calls)
        except TimeoutError as exc:
            raise OpenAIError(503, f"{method}: replicas did not answer in time") from exc
        answers: list[dict[str, Any]] = []
        failures: list[str] = []
        for name, results in zip(names, per_deployment, strict=True):
            for result in results:
                if isinstance(result, BaseException):
                    lines = str(result).strip().splitlines() or [type(result).__name__]
                    failures.append(f"{name}: {lines[-1]}")
                else:
                    answers.append(result)
        if failures:
            raise OpenAIError(503, f"{method} failed on " + "; ".join(failures))
        if not answers:
            raise OpenAIError(503, f"{method}: no engine replica is running")
        return answers
