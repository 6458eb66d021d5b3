"""The application-level autoscaling policy (router/autoscaling.py) on a live Serve cluster.

A disaggregated app on a tiny random model is deployed through the controller's config path
(what `serve run` and `serve deploy` do) with ``autoscaling_policy:
router.autoscaling:PDAutoscalingPolicy``, small replica bounds, fractional CPUs and short
look-back and delays. A bounded burst of concurrent requests drives the decode replicas'
running requests (reported through ``record_autoscaling_stats``) over target: the policy must
grow decode and, through the decode/prefill ratio, prefill with it; while one client keeps
sending, the burst ends and both must shrink back to their minimum, a replica at a time.
Every answer, including those served while replicas start and drain, must equal the offline
engine's greedy output for the same prompt (nothing lost, nothing cut short), and the
remaining engines must return to idle.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
from conftest import busy_engines  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.context import _get_global_client  # noqa: E402
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from neuron_runtime import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.ray

APP = "autoscale"
MAX_TOKENS = 48
BURST_CLIENTS = 8
DOWNSCALE_DELAY_S = 2.0
PROMPTS = [f"Request {i}: tell me about the number {i}." for i in range(BURST_CLIENTS)]
PREFILL_MAX, DECODE_MAX = 2, 3
MIN_RATIO, MAX_RATIO = 1.0, 2.0
# Replicas and handles push their autoscaling metrics every 0.5 s (Serve's default is 10 s).
# Ray 2.60 reads the push interval from the deprecated ``metrics_interval_s`` of the deployment's
# autoscaling_config; the environment variables are its announced replacement.
METRICS_INTERVAL_S = 0.5
FAST_METRICS = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": str(METRICS_INTERVAL_S),
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": str(METRICS_INTERVAL_S),
}


def engine_deployment(name: str, max_replicas: int) -> dict[str, Any]:
    return {
        "name": name,
        "autoscaling_config": {
            "min_replicas": 1,
            "max_replicas": max_replicas,
            "metrics_interval_s": METRICS_INTERVAL_S,
            "look_back_period_s": 1.0,
            "upscale_delay_s": 0.5,
            "downscale_delay_s": DOWNSCALE_DELAY_S,
        },
        "graceful_shutdown_timeout_s": 30,
        "ray_actor_options": {"num_cpus": 0.1},
    }


def app_config(model: Path, port: int) -> dict[str, Any]:
    return {
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": APP,
                "route_prefix": f"/{APP}",
                "import_path": "app.builder:build_app",
                "runtime_env": {"env_vars": FAST_METRICS},
                "autoscaling_policy": {
                    "policy_function": "router.autoscaling:PDAutoscalingPolicy",
                    "policy_kwargs": {
                        "prefill_target_ongoing": 4,
                        # TTFT on this shared box says nothing: only the queues count here.
                        "ttft_target_s": 60.0,
                        "decode_target_running": 1,
                        "min_decode_per_prefill": MIN_RATIO,
                        "max_decode_per_prefill": MAX_RATIO,
                    },
                },
                "args": {
                    "mode": "disaggregated",
                    "model": str(model),
                    "max_model_len": 256,
                    "embedding_model": None,
                    "disaggregation": {"kv_transport": "object_store"},
                    "engine_args": {"num_kv_blocks": 96, "max_num_seqs": 16},
                },
                "deployments": [
                    {"name": "OpenAIIngress", "ray_actor_options": {"num_cpus": 0.1}},
                    {"name": "PDRouter", "ray_actor_options": {"num_cpus": 0.1}},
                    engine_deployment("PrefillServer", PREFILL_MAX),
                    engine_deployment("DecodeServer", DECODE_MAX),
                ],
            }
        ],
    }


class Clients:
    """Threads that send completions one after another until told to stop; every answer is
    kept with its prompt (an exception is kept as the answer)."""

    def __init__(self, base_url: str, model: str) -> None:
        self.api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        self.model = model
        self.answers: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._threads: list[tuple[threading.Thread, threading.Event]] = []

    def start(self, prompts: list[str]) -> None:
        for prompt in prompts:
            stop = threading.Event()
            thread = threading.Thread(target=self._run, args=(prompt, stop), daemon=True)
            thread.start()
            self._threads.append((thread, stop))

    def stop(self, keep: int = 0) -> None:
        """Stops all but the first ``keep`` clients and waits for their last answers."""
        stopping = self._threads[keep:]
        self._threads = self._threads[:keep]
        for _, stop in stopping:
            stop.set()
        for thread, _ in stopping:
            thread.join(timeout=180)
            assert not thread.is_alive(), "a request never finished"

    def _run(self, prompt: str, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                answer: Any = self.api.completions.create(
                    model=self.model,
                    prompt=prompt,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
            except Exception as exc:  # kept and reported by the test
                answer = exc
            with self._lock:
                self.answers.append((prompt, answer))


def replicas(details: dict[str, Any], name: str) -> tuple[int, int]:
    """(target, running) replicas of a deployment ((0, 0) before the app has built it)."""
    deployment = details["deployments"].get(name)
    if deployment is None:
        return 0, 0
    running = sum(1 for r in deployment["replicas"] if r["state"] == "RUNNING")
    return deployment["target_num_replicas"], running


def watch(
    until, timeout_s: float, timeline: list[tuple[int, int, int, int, float]], clients: Clients
) -> None:
    """Polls the app's replica counts (prefill target and running, decode target and running,
    the time of the poll) into ``timeline`` until ``until(prefill, decode)`` holds for the
    running counts."""
    client = _get_global_client()
    deadline = time.monotonic() + timeout_s
    while True:
        details = client.get_serve_details()["applications"].get(APP, {"deployments": {}})
        assert details.get("status") != "DEPLOY_FAILED", details.get("message")
        prefill, decode = replicas(details, "PrefillServer"), replicas(details, "DecodeServer")
        timeline.append((*prefill, *decode, time.monotonic()))
        if until(prefill[1], decode[1]):
            return
        if time.monotonic() > deadline:
            failed = [a for _, a in clients.answers if isinstance(a, Exception)]
            raise AssertionError(
                f"timed out; {len(clients.answers)} answers, {len(failed)} failed "
                f"({failed[:1]}); (target, running) so far: {changes(timeline)}"
            )
        time.sleep(0.25)


def changes(timeline: list[tuple[int, int, int, int, float]]) -> str:
    """The polls whose counts differ from the poll before: "+seconds: prefill (target, running),
    decode (target, running)" (a failure message short enough to read whole)."""
    if not timeline:
        return "no polls"
    start, last, lines = timeline[0][4], None, []
    for *counts, at in timeline:
        if counts != last:
            lines.append(f"+{at - start:.1f}s P{tuple(counts[:2])} D{tuple(counts[2:])}")
            last = counts
    return "; ".join(lines) + f" (last poll +{timeline[-1][4] - start:.1f}s)"


def test_a_burst_scales_prefill_and_decode_together_and_idle_scales_them_back(
    serve_cluster: str, tiny_llama_path: Path
) -> None:
    port = int(serve_cluster.rsplit(":", 1)[1])
    client = _get_global_client()
    client.deploy_apps(ServeDeploySchema.model_validate(app_config(tiny_llama_path, port)))
    timeline: list[tuple[int, int, int, int, float]] = []
    clients = Clients(f"{serve_cluster}/{APP}/v1", str(tiny_llama_path))
    try:
        watch(lambda p, d: p == 1 and d == 1, 300, timeline, clients)
        clients.start(PROMPTS)
        # The burst lasts until both deployments run at their maxima (bounded by the timeout).
        watch(lambda p, d: p == PREFILL_MAX and d == DECODE_MAX, 180, timeline, clients)
        # One client keeps sending while the others stop: replicas leave under load.
        clients.stop(keep=1)
        watch(lambda p, d: p == 1 and d == 1, 180, timeline, clients)
        clients.stop()

        # The policy's decisions kept decode/prefill within the ratio. Serve applies one
        # decision to the two deployments' targets one after the other, so a single poll can
        # fall between the two; a pair of targets seen by two polls in a row is a decision.
        targets = [(p, d) for p, _, d, _, _ in timeline]
        for (prefill_target, decode_target), again in zip(targets, targets[1:], strict=False):
            if again == (prefill_target, decode_target):
                assert MIN_RATIO * prefill_target <= decode_target <= MAX_RATIO * prefill_target, (
                    changes(timeline)
                )
        # Scale-down went a replica at a time: the policy sheds at most one running replica per
        # decision, and Serve applies a scale-down decision only after DOWNSCALE_DELAY_S of the
        # same recommendation, so two polls closer than that see the running count drop by at
        # most one (polls further apart, on a loaded box, may span two decisions).
        for (_, p0, _, d0, t0), (_, p1, _, d1, t1) in zip(timeline, timeline[1:], strict=False):
            if t1 - t0 < DOWNSCALE_DELAY_S:
                assert p1 >= p0 - 1 and d1 >= d0 - 1, changes(timeline)

        # Nothing lost: every answer is the offline engine's greedy output for its prompt.
        offline = LLM(model=str(tiny_llama_path), max_model_len=256, num_kv_blocks=96)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = offline.generate(PROMPTS, params)
        expected = {p: out.outputs[0].text for p, out in zip(PROMPTS, outputs, strict=True)}
        assert len(clients.answers) >= BURST_CLIENTS
        for prompt, answer in clients.answers:
            assert not isinstance(answer, Exception), f"{prompt!r}: {answer!r}"
            assert answer.choices[0].finish_reason == "length"
            assert answer.usage.completion_tokens == MAX_TOKENS
            assert answer.choices[0].text == expected[prompt], prompt

        # The engines that stay are idle.
        for name in ("PrefillServer", "DecodeServer"):
            handle = serve.get_deployment_handle(name, app_name=APP)
            deadline = time.monotonic() + 30
            while busy_engines([handle.stats.remote().result(timeout_s=30)]):
                assert time.monotonic() < deadline, f"{name} still busy"
                time.sleep(0.5)
    finally:
        clients.stop()
        serve.delete(APP)
