"""Chaos harness: deploy an application through the config path, load it, SIGKILL a replica.

A case names the deployment whose replica dies and the load that runs meanwhile. Every
request is sorted by what the client got:

- completed: a 200 answer, or a stream that ended with ``data: [DONE]`` and no error event;
- failed cleanly: an HTTP error with the OpenAI error body, or a stream whose last events are
  an error event and ``data: [DONE]``;
- unclean: anything else (a cut connection, a body that is not the OpenAI error);
- hung: no final answer within the request deadline.

After the kill the harness measures how long until a fresh request of the same kind succeeds
(served again) and until Serve runs the deployment at full strength (replaced), then waits for
every replica, survivors and replacement, to be back at its idle baseline: no request running
or waiting, no KV block used or held, no KV ticket in a router, no image being encoded.

A case for a replica that holds request state (decode, colocated, PD router) is one more
``ChaosCase`` with ``max_failed=0`` and a ``migrations`` counter; the report has the migrated
column.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from conftest import busy_engines
from PIL import Image
from ray import serve
from ray.serve.context import _get_global_client
from ray.serve.schema import ServeDeploySchema

ENGINE_DEPLOYMENTS = ("PrefillServer", "DecodeServer", "LLMServer")


# -- deploying ------------------------------------------------------------------------------


def deploy(
    name: str,
    route_prefix: str,
    args: dict[str, Any],
    deployments: list[dict[str, Any]],
    port: int,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """``app.builder:build_app`` with ``args`` deployed as a Serve config file would be
    (``deploy_apps``, what `serve run CONFIG` does); the app's details once it runs."""
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": name,
                "route_prefix": route_prefix,
                "import_path": "app.builder:build_app",
                "args": args,
                "deployments": deployments,
            }
        ],
    }
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
    return wait_running(name, timeout_s)


def app_details(name: str) -> dict[str, Any]:
    return _get_global_client().get_serve_details()["applications"].get(name, {})


def wait_running(name: str, timeout_s: float = 300.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        app = app_details(name)
        status = app.get("status")
        assert status != "DEPLOY_FAILED", app.get("message")
        if status == "RUNNING" and all(
            len(running_replicas(app, d)) == wanted_replicas(app, d) for d in app["deployments"]
        ):
            return app
        assert time.monotonic() < deadline, f"{name} still {status}: {app.get('message')}"
        time.sleep(0.5)


def running_replicas(app: dict[str, Any], deployment: str) -> list[dict[str, Any]]:
    return [r for r in app["deployments"][deployment]["replicas"] if r["state"] == "RUNNING"]


def wanted_replicas(app: dict[str, Any], deployment: str) -> int:
    config = app["deployments"][deployment]["deployment_config"]
    autoscaling = config.get("autoscaling_config") or {}
    return int(config.get("num_replicas") or autoscaling.get("min_replicas", 1))


# -- replica stats ----------------------------------------------------------------------------

# Deployments whose replicas answer ``stats`` (EmbeddingServer keeps no request state).
WITH_STATS = (*ENGINE_DEPLOYMENTS, "PDRouter", "VisionEncoder")
# Engine fields that are 0 on an idle replica, beyond conftest.busy_engines': blocks held for
# a handoff or a read, grammar states.
HELD_FIELDS = ("num_kv_blocks_held", "num_kv_handoffs_held", "num_kv_reads", "num_grammar_states")


def replica_stats(
    app: str, deployment: str, replica_ids: set[str], timeout_s: float = 60.0
) -> dict[str, Any]:
    """The stats of each replica in ``replica_ids``. The handle's router picks the shorter
    queue, so a replica still streaming is reached only once its queue is no longer. Calls go
    back to back: with a pause between them, every call of a CI run went to the same one of
    two idle encoders for 60 s. A call that lands on a replica that just died is retried."""
    handle = serve.get_deployment_handle(deployment, app_name=app)
    seen: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            stats = handle.stats.remote().result(timeout_s=10)
        except Exception:  # noqa: BLE001 - a dead replica the handle has not dropped yet
            time.sleep(0.2)
            continue
        replica_id = _stats_replica_id(stats)
        if replica_id in replica_ids:
            seen[replica_id] = stats
        if set(seen) == replica_ids:
            return seen
    raise AssertionError(f"{deployment}: saw {sorted(seen)} of {sorted(replica_ids)}")


def _stats_replica_id(stats: Any) -> str:
    if isinstance(stats, list):  # PDRouter: the engines it heard from, then its own
        return str(stats[-1]["replica_id"]).removeprefix("router:")
    return str(stats["replica_id"])


def live_replicas(app: str, deployment: str, dead: Collection[str] = ()) -> set[str]:
    return {r["replica_id"] for r in running_replicas(app_details(app), deployment)} - set(dead)


def busy_replicas(app: str, dead: Collection[str] = ()) -> list[dict[str, Any]]:
    """Every RUNNING replica of the app (but those in ``dead``) that is not at its idle
    baseline, with the figures that say why."""
    busy: list[dict[str, Any]] = []
    for deployment in app_details(app)["deployments"]:
        if deployment not in WITH_STATS:
            continue
        ids = live_replicas(app, deployment, dead)
        for replica_id, stats in replica_stats(app, deployment, ids).items():
            if deployment == "PDRouter":
                refs = stats[-1].get("num_kv_refs_held", 0)
                busy += [{"router": replica_id, "num_kv_refs_held": refs}] if refs else []
            elif deployment == "VisionEncoder":
                busy += [{"encoder": replica_id, **stats}] if stats["num_pending"] else []
            elif busy_engines([stats]) or any(stats.get(key) for key in HELD_FIELDS):
                busy.append({"deployment": deployment, **stats})
    return busy


def wait_baseline(app: str, dead: Collection[str] = (), timeout_s: float = 60.0) -> float:
    """Seconds until every live replica of the app is idle; AssertionError naming the busy."""
    start = time.monotonic()
    while True:
        busy = busy_replicas(app, dead)
        if not busy:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, f"{app} not back to baseline: {busy}"
        time.sleep(0.3)


# -- requests and their outcomes ----------------------------------------------------------------

COMPLETED, FAILED_CLEANLY, UNCLEAN, HUNG = "completed", "failed cleanly", "unclean", "hung"


@dataclass(frozen=True)
class Call:
    """One HTTP request of a load: POST ``body`` to ``path`` (streamed when body says so)."""

    path: str
    body: dict[str, Any]
    # A completed stream's text (n > 1: its choices' texts, in index order) is appended here
    # when set (cases comparing outputs).
    texts: list[str | tuple[str, ...]] | None = field(default=None, compare=False)


def is_error_body(data: Any) -> bool:
    error = data.get("error") if isinstance(data, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error


@dataclass(frozen=True)
class Outcome:
    """One of the four outcomes above and what the client saw when it was not COMPLETED (the
    error body or event, the exception, the last events): a failing case prints them."""

    kind: str
    detail: str = ""


def outcome(
    base: str, call: Call, deadline_s: float, streaming: threading.Event | None = None
) -> Outcome:
    """What the client got for ``call``. ``streaming`` is set when a stream's first event
    arrives (an engine is working on it)."""
    try:
        if call.body.get("stream"):
            return _stream_outcome(base, call, deadline_s, streaming)
        response = httpx.post(base + call.path, json=call.body, timeout=deadline_s)
    except httpx.TimeoutException as e:
        return Outcome(HUNG, repr(e))
    except httpx.TransportError as e:
        return Outcome(UNCLEAN, repr(e))
    try:
        data = response.json()
    except ValueError:
        return Outcome(UNCLEAN, f"{response.status_code}: {response.text[:300]!r}")
    if response.status_code == 200:
        return Outcome(COMPLETED)
    kind = FAILED_CLEANLY if is_error_body(data) else UNCLEAN
    return Outcome(kind, f"{response.status_code}: {json.dumps(data)[:300]}")


def _stream_outcome(
    base: str, call: Call, deadline_s: float, streaming: threading.Event | None
) -> Outcome:
    events: list[str] = []
    stop = time.monotonic() + deadline_s

    def seen() -> str:
        return f"{len(events)} events, the last: {' | '.join(events[-3:])[:400]}"

    try:
        with httpx.stream("POST", base + call.path, json=call.body, timeout=deadline_s) as reply:
            if reply.status_code != 200:
                reply.read()
                kind = FAILED_CLEANLY if is_error_body(reply.json()) else UNCLEAN
                return Outcome(kind, f"{reply.status_code}: {reply.text[:300]}")
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if streaming is not None:
                        streaming.set()
                if time.monotonic() > stop:
                    return Outcome(HUNG, seen())
    except httpx.TimeoutException as e:
        return Outcome(HUNG, f"{e!r}; {seen()}")
    except (httpx.TransportError, ValueError) as e:
        return Outcome(UNCLEAN, f"{e!r}; {seen()}")
    if not events or events[-1] != "[DONE]":
        return Outcome(UNCLEAN, f"no [DONE]; {seen()}")
    errors = [e for e in events[:-1] if is_error_body(json.loads(e))]
    if not errors:
        if call.texts is not None:
            by_index: dict[int, str] = {}
            for event in events[:-1]:
                for choice in json.loads(event)["choices"]:
                    index = choice["index"]
                    by_index[index] = by_index.get(index, "") + choice.get("text", "")
            texts = tuple(by_index[i] for i in sorted(by_index))
            call.texts.append(texts[0] if len(texts) == 1 else texts)
        return Outcome(COMPLETED)
    return Outcome(FAILED_CLEANLY if errors == [events[-2]] else UNCLEAN, seen())


# -- cases ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChaosCase:
    """SIGKILL one replica of ``deployment`` while ``calls`` run ``concurrency`` at a time.

    ``kill_after_s``: when the kill lands after the load starts. ``probe``: a request of the
    same kind that must succeed again after the kill. ``max_failed``: how many requests may
    fail cleanly (None: any; a case whose requests migrate sets 0, and ``migrations``).
    """

    name: str
    deployment: str
    calls: list[Call]
    probe: Call
    concurrency: int = 8
    kill_after_s: float = 0.5
    max_failed: int | None = None
    request_deadline_s: float = 90.0
    # The app's cumulative count of migrated requests (for deployments that migrate them,
    # e.g. from the PD router's stats); the report shows the difference over the case.
    migrations: Callable[[str], int] | None = None


@dataclass
class ChaosReport:
    case: str
    killed: str
    busy_at_kill: bool
    counts: dict[str, int] = field(default_factory=dict)
    migrated: int | None = None  # None: the deployment does not migrate requests
    # What the client saw for each request that did not complete (Outcome.detail).
    not_completed: list[str] = field(default_factory=list)
    served_again_s: float | None = None
    replaced_s: float | None = None
    baseline_s: float | None = None
    replacement: threading.Thread | None = None  # times replaced_s in the background

    def row(self) -> str:
        migrated = "-" if self.migrated is None else str(self.migrated)
        return (
            f"{self.case:<10} {self.counts.get(COMPLETED, 0):>9} {migrated:>8} "
            f"{self.counts.get(FAILED_CLEANLY, 0):>8} {self.counts.get(UNCLEAN, 0):>7} "
            f"{self.counts.get(HUNG, 0):>4} {_s(self.served_again_s):>11} "
            f"{_s(self.replaced_s):>9} {_s(self.baseline_s):>9}  busy at kill: {self.busy_at_kill}"
        )


HEADER = (
    f"{'case':<10} {'completed':>9} {'migrated':>8} {'failed':>8} {'unclean':>7} {'hung':>4} "
    f"{'served (s)':>11} {'repl. (s)':>9} {'idle (s)':>9}"
)


def reference_texts(
    model_path: Any, calls: list[Call], max_model_len: int
) -> list[str | tuple[str, ...]]:
    """Each completion call's text (n > 1: its choices' texts) from the offline engine, the
    unbroken reference: greedy, or seeded with the call's sampling fields."""
    from neuron_runtime import LLM, SamplingParams

    llm = LLM(model=str(model_path), max_model_len=max_model_len, num_kv_blocks=128)
    texts: list[str | tuple[str, ...]] = []
    for call in calls:
        body = call.body
        params = SamplingParams(
            temperature=body.get("temperature", 1.0),
            seed=body.get("seed"),
            n=body.get("n", 1),
            max_tokens=body["max_tokens"],
            ignore_eos=body.get("ignore_eos", False),
        )
        (out,) = llm.generate({"prompt_token_ids": body["prompt"]}, params)
        choices = tuple(completion.text for completion in out.outputs)
        texts.append(choices[0] if len(choices) == 1 else choices)
    return texts


def ingress_migrations(base: str) -> int:
    """The ingress's count of migrated requests (its /metrics)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("neuron:request_migrations_total")
        )
    )


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def run_case(
    base: str, app: str, case: ChaosCase, holds_work: Callable[[Any], bool]
) -> ChaosReport:
    """Runs the load, kills one RUNNING replica of the case's deployment (the first one seen
    holding work, ``holds_work`` of its stats, within a few seconds, else any), and measures
    the outcome. Serve's replacement of the replica is timed in the background
    (``report.replacement``); the survivors must be back at their baseline on return."""
    replicas = running_replicas(app_details(app), case.deployment)
    migrated_before = case.migrations(app) if case.migrations else 0
    streaming = threading.Event()
    with ThreadPoolExecutor(case.concurrency) as pool:
        futures = [
            pool.submit(outcome, base, call, case.request_deadline_s, streaming)
            for call in case.calls
        ]
        time.sleep(case.kill_after_s)
        victim, busy = _pick_victim(app, case.deployment, replicas, holds_work, streaming)
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        report = ChaosReport(case.name, f"{case.deployment} {victim['replica_id']}", busy)
        report.replacement = threading.Thread(
            target=_time_replacement,
            args=(report, app, case.deployment, victim["replica_id"], len(replicas), killed_at),
            daemon=True,
        )
        report.replacement.start()
        report.served_again_s = _served_again(base, case.probe, killed_at, case.request_deadline_s)
        results = [f.result() for f in futures]
    kinds = [result.kind for result in results]
    report.counts = {kind: kinds.count(kind) for kind in (COMPLETED, FAILED_CLEANLY, UNCLEAN, HUNG)}
    report.not_completed = [f"{r.kind}: {r.detail}" for r in results if r.kind != COMPLETED]
    report.baseline_s = wait_baseline(app, dead={victim["replica_id"]})
    if case.migrations:
        report.migrated = case.migrations(app) - migrated_before
    return report


def _pick_victim(
    app: str,
    deployment: str,
    replicas: list[dict[str, Any]],
    holds_work: Callable[[Any], bool],
    streaming: threading.Event,
    patience_s: float = 10.0,
) -> tuple[dict[str, Any], bool]:
    """The replica to kill and whether it held work. A ``stats`` call goes to the replica with
    the shorter queue, so while one replica streams every request of the load, the calls reach
    only the idle others: once the load streams and every engine replica but one has been seen
    with nothing running or waiting, that one holds the work (the case's ``migrations`` count
    then confirms it)."""
    if deployment not in WITH_STATS:
        return replicas[0], True
    by_id = {r["replica_id"]: r for r in replicas}
    seen_idle: set[str] = set()
    handle = serve.get_deployment_handle(deployment, app_name=app)
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        stats = handle.stats.remote().result(timeout_s=10)
        replica_id = _stats_replica_id(stats)
        if replica_id not in by_id:
            continue
        if holds_work(stats):
            return by_id[replica_id], True
        if streaming.is_set() and deployment in ENGINE_DEPLOYMENTS:
            seen_idle.add(replica_id)
            others = sorted(set(by_id) - seen_idle)
            if len(others) == 1:
                return by_id[others[0]], True
    return replicas[0], False


def _served_again(base: str, probe: Call, since: float, deadline_s: float) -> float | None:
    """Seconds from ``since`` until ``probe`` completes (None: not within ``deadline_s``)."""
    while time.monotonic() - since < deadline_s:
        if outcome(base, probe, deadline_s).kind == COMPLETED:
            return time.monotonic() - since
        time.sleep(0.2)
    return None


def _time_replacement(
    report: ChaosReport, app: str, deployment: str, dead_id: str, wanted: int, since: float
) -> None:
    """Sets ``report.replaced_s``: seconds from ``since`` until ``wanted`` replicas run again,
    the dead one not among them (left None after 180 s)."""
    while time.monotonic() - since < 180:
        running = running_replicas(app_details(app), deployment)
        if len(running) == wanted and dead_id not in {r["replica_id"] for r in running}:
            report.replaced_s = time.monotonic() - since
            return
        time.sleep(0.3)


# -- loads ------------------------------------------------------------------------------------


def png_url(seed: int, size: tuple[int, int] = (64, 48)) -> str:
    """A data: URL of a random PNG (a distinct image per seed: each one must be encoded)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def text_prompt(seed: int, length: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(100, 40000, length)]
