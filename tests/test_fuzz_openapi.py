"""schemathesis against the running app's ``/openapi.json``: every route, bounded examples.

The schema is read from the disaggregated app (conftest ``fuzz_app``: encode -> prefill ->
decode on the tiny LLaVA, plus embeddings) over HTTP, as a client would. For each operation
schemathesis draws positive cases (bodies the schema allows) and negative ones (bodies it
does not); every answer must not be a server error, and every 4xx must carry the OpenAI error
body. The number of examples per operation and mode, and the status codes seen, are printed.
Afterwards the engines answer and every replica is back at its idle baseline.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
schemathesis = pytest.importorskip("schemathesis")
import httpx  # noqa: E402
from chaos.harness import is_error_body, wait_baseline  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

# Examples per operation and mode: the body-less routes have little to draw.
MAX_EXAMPLES = {"POST": 25, "GET": 3}
REQUEST_DEADLINE_S = 60.0


def test_every_route(fuzz_app, capsys) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzz_app}/openapi.json", timeout=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings"} <= paths
    assert {"/v1/responses", "/v1/models", "/tokenize", "/detokenize", "/health"} <= paths
    lines = []
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode == GenerationMode.NEGATIVE and (
                op.method.upper() == "GET" or not takes_input(op)
            ):
                continue  # no body to get wrong (GETs, /start_profile, /stop_profile)
            statuses = fuzz_operation(op, mode, fuzz_app)
            seen = ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))
            total = sum(statuses.values())
            lines.append(
                f"schemathesis {op.method.upper()} {op.path} {mode.value}: {total} ({seen})"
            )
    with capsys.disabled():
        print()
        for line in lines:
            print(line)
    assert httpx.get(f"{fuzz_app}/health", timeout=30).status_code == 200
    wait_baseline("fuzz")


def takes_input(op: Any) -> bool:
    """Whether the operation declares a body or parameters (negative cases need one)."""
    return bool(op.body.items) or any(True for _ in op.iter_parameters())


def fuzz_operation(op: Any, mode: GenerationMode, base: str) -> dict[int, int]:
    """Runs ``op``'s strategy for ``mode``; the count of each status code answered."""
    statuses: dict[int, int] = {}

    @settings(
        max_examples=MAX_EXAMPLES.get(op.method.upper(), 10),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        response = case.call(base_url=base, timeout=REQUEST_DEADLINE_S)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        case.validate_response(response, checks=[not_a_server_error])
        if 400 <= response.status_code < 500:
            assert is_error_body(response.json()), response.text

    run()
    return statuses
