"""Request routers' decisions as spans in the request's trace: which replica, and why.

A request router (router/request_routers.py) notes what it saw when it ranked the replicas
(queue lengths, prefix-match shares, free KV blocks); when Serve reports the request routed,
one ``route.<stage>`` span is recorded under the request's trace context, from the request's
arrival at the router to the routing, with the chosen replica and the reason. Requests that
are not traced cost one attribute test.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from neuron_runtime import tracing

# Decisions kept for requests not yet routed (Serve may drop a request, e.g. on cancel).
MAX_PENDING = 4096


class RouteTrace:
    def __init__(self, stage: str) -> None:
        self.stage = stage  # "prefill", "decode", "encoder"
        self._pending: OrderedDict[str, tuple[dict[str, str], float, dict[str, Any]]] = (
            OrderedDict()
        )

    def note(self, pending: Any, request: Any, seen: dict[str, Any]) -> None:
        """What the router saw for this request's latest ranking (``seen``: attributes)."""
        context = getattr(request, "trace_context", None)
        if context is None or not tracing.enabled():
            return
        created_at = float(getattr(pending, "created_at", time.time()))
        self._pending[_key(pending)] = (context, created_at, seen)
        self._pending.move_to_end(_key(pending))
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def routed(self, pending: Any, replica_id: str, reason: str, **chosen: Any) -> None:
        """Records the span: the chosen replica, the reason and what the router saw."""
        noted = self._pending.pop(_key(pending), None)
        if noted is None:
            return
        context, created_at, seen = noted
        attributes = {
            **seen,
            "neuron_serve.route.replica": replica_id,
            "neuron_serve.route.reason": reason,
            **{f"neuron_serve.route.{k}": v for k, v in chosen.items() if v is not None},
        }
        tracing.record_span(
            f"route.{self.stage}",
            context,
            int(created_at * 1e9),
            tracing.now_ns(),
            attributes,
        )


def _key(pending: Any) -> str:
    metadata = getattr(pending, "metadata", None)
    return str(getattr(metadata, "internal_request_id", id(pending)))
