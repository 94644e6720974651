"""What every request goes through before the app (ASGI middleware): request counts and latency
(/metrics); the API key on /v1 and /metrics (401); the body, read whole before the app runs: more than
--max-body is 413 (declared or not), a body that stalls is 408, one that is not UTF-8 is 400; on
POST /v1 it is JSON whatever its Content-Type.
"""

from __future__ import annotations

import asyncio
import hmac
import time

from .errors import APIError, invalid_json, too_large

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for a request body to arrive once its headers have


def _endpoint(path: str) -> str:
    return path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")


def _header(scope, name: bytes) -> bytes | None:
    value = None
    for k, v in scope["headers"]:
        if k == name:
            value = v  # the last of a repeated header wins
    return value


async def _send_error(error: APIError, scope, receive, send) -> None:
    await error.response()(scope, receive, send)


class Gate:
    """Metrics around everything; before the app: the API key, the body (size, time, encoding,
    JSON content type)."""

    def __init__(self, app, *, api_key: str | None, max_body: int, metrics,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body
        self.metrics = metrics
        self.body_timeout = body_timeout

    def authorized(self, scope) -> bool:
        """`Authorization: Bearer KEY`; the scheme is case-insensitive (RFC 9110), the key is
        compared in constant time."""
        given = _header(scope, b"authorization") or b""
        scheme, _, token = given.strip().partition(b" ")
        ok_scheme = scheme.lower() == b"bearer"
        return hmac.compare_digest(token.strip(), self.api_key) and ok_scheme

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = _endpoint(scope["path"])
        t0 = time.perf_counter()
        status = 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.request_latency.labels(endpoint).observe(time.perf_counter() - t0)

    async def _handle(self, scope, receive, send) -> None:
        path, method = scope["path"], scope["method"]
        keyed = path.startswith("/v1") or path == "/metrics"
        if keyed and self.api_key is not None and not self.authorized(scope):
            await _send_error(APIError(
                401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"}), scope, receive, send)
            return
        if method not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        try:
            length = int(_header(scope, b"content-length") or b"-1")
        except ValueError:
            length = -1
        if length > self.max_body:
            await _send_error(too_large(self.max_body), scope, receive, send)
            return
        body = await self._read_body(receive)
        if isinstance(body, APIError):
            await _send_error(body, scope, receive, send)
            return
        if body is None:  # the client went away mid-body: nobody to answer
            return
        if path.startswith("/v1"):
            # one rule for every Content-Type: the body is UTF-8 JSON (curl -d sends a form type,
            # others text/plain, text/json, application/x-ndjson...)
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as e:
                await _send_error(invalid_json(f"not UTF-8: byte 0x{body[e.start]:02x} at offset {e.start}"),
                                  scope, receive, send)
                return
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-type"]
                         + [(b"content-type", b"application/json")])
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then: http.disconnect when the client goes away

        await self.app(scope, replay, send)

    async def _read_body(self, receive) -> bytes | APIError | None:
        """The whole body: an APIError when it is too large or too slow, None when the client left."""
        parts: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return APIError(408, f"The request body did not arrive within {self.body_timeout:g} s.",
                                code="request_timeout", headers={"Connection": "close"})
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return too_large(self.max_body)
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)
