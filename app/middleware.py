"""Edge checks as one pure ASGI middleware: API key, content type and body size; and the
request's root span when tracing is on (neuron_runtime/tracing.py).

Pure ASGI (not BaseHTTPMiddleware) so streamed responses and client disconnects pass through
untouched. Ray Serve's proxy already echoes (or assigns) ``X-Request-Id``. The root span covers
the whole exchange, the streamed body included, and continues the client's trace when the
request carries a W3C ``traceparent``.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import error_body
from neuron_runtime import tracing

# Paths that stay open without the API key: probes and scrapes.
OPEN_PATHS = ("/health", "/metrics")


class _BodyTooLarge(Exception):
    pass


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        path = scope["path"]
        if not tracing.enabled() or path.endswith(OPEN_PATHS):
            await self._handle(scope, receive, send, headers)
            return
        trace_headers = {
            name: headers[name].decode("latin-1")
            for name in ("traceparent", "tracestate")
            if name in headers
        }
        attributes = {"http.request.method": scope["method"], "url.path": path}
        request_id = headers.get("x-request-id")
        if request_id:
            attributes["http.request.header.x-request-id"] = request_id.decode("latin-1")[:64]
        name = f"{scope['method']} {path}"
        with tracing.root_span(name, trace_headers, attributes) as root:
            if root is None:  # not sampled
                await self._handle(scope, receive, send, headers)
                return

            async def traced_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    root.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        tracing.set_error(root, f"HTTP {status}")
                await send(message)

            await self._handle(scope, receive, traced_send, headers)

    async def _handle(
        self, scope: Scope, receive: Receive, send: Send, headers: dict[str, bytes]
    ) -> None:
        path = scope["path"]
        if self.api_key is not None and not path.endswith(OPEN_PATHS):
            given = headers.get("authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                await _reply(send, 401, "invalid or missing API key (Authorization: Bearer ...)")
                return
        if scope["method"] == "POST":
            content_type = headers.get("content-type", b"").split(b";")[0].strip().lower()
            if content_type != b"application/json":
                await _reply(send, 415, "Content-Type must be application/json")
                return
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                await _reply(send, 413, f"request body exceeds {self.max_body_bytes} bytes")
                return
        received = 0
        started = False

        async def capped_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, capped_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _reply(send, 413, f"request body exceeds {self.max_body_bytes} bytes")


async def _reply(send: Send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
