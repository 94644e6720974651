"""What every request goes through before the app (ASGI middleware), outermost first:

    Guard      request counts and latency (/metrics); the Host header (DNS rebinding: 403
               host_not_allowed) and the Origin header (cross-site requests from web pages: 403
               origin_not_allowed), for every path and method
    CORS       Starlette's CORSMiddleware for the origins allowed with --cors-origin: preflight
               OPTIONS answers and Access-Control-* headers on responses
    Gate       OPTIONS without a preflight (204 with Allow); the API key on /v1 and /metrics (401);
               the body, read whole before the app runs: more than --max-body is 413 (declared or
               not), a body that stalls is 408, one that is not UTF-8 is 400; on POST /v1 it is
               JSON whatever its Content-Type

Browsers send Origin on every cross-origin request and on every POST; curl, the openai client and
other programs do not send it at all, so the Origin check only ever stops web pages.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import socket
import time
from typing import Callable, Iterable, Sequence
from urllib.parse import urlsplit

from localspec.server.errors import APIError, invalid_json, too_large

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
LOOPBACK_NAMES = ("localhost",)  # and *.localhost (RFC 6761: always loopback, browsers never ask DNS)
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for a request body to arrive once its headers have
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _endpoint(path: str) -> str:
    return path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")


def _header(scope, name: bytes) -> bytes | None:
    value = None
    for k, v in scope["headers"]:
        if k == name:
            value = v  # the last of a repeated header wins
    return value


def split_host(value: str) -> tuple[str, int | None] | None:
    """'Example.COM:8080' -> ('example.com', 8080); '[::1]' -> ('::1', None); None when malformed."""
    value = value.strip().lower()
    if not value:
        return None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
    else:
        host, _, port_text = value.partition(":")
        port_text = port_text if ":" in value else None
    port = None
    if port_text is not None:
        if not port_text.isdigit() or len(port_text) > 5:
            return None
        port = int(port_text)
    host = host.removesuffix(".")
    if not host or any(c in host for c in "/\\@ ?#"):
        return None
    return host, port


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class HostRule:
    """Which Host headers the server answers (DNS-rebinding protection: a web page whose name was
    re-pointed at this machine sends its own name as Host). Allowed: IP literals the server can be
    reached at (any IP when it listens on every interface, loopback IPs when on loopback, the bound
    IP otherwise), 'localhost' and '*.localhost', the bound name (--host NAME), this machine's
    host name when listening on every interface, and the --allowed-host names ('*.example.com'
    for a domain and its subdomains, '*' for any). Ports are not compared (a forwarded port is
    fine: a rebinding attack always shows in the name)."""

    def __init__(self, bind_host: str, allowed: Iterable[str] = ()) -> None:
        self.any = False
        self.names: set[str] = set(LOOPBACK_NAMES)
        self.suffixes: list[str] = [".localhost"]
        for pattern in allowed:
            pattern = pattern.strip().lower().removesuffix(".")
            if pattern == "*":
                self.any = True
            elif pattern.startswith("*."):
                self.suffixes.append(pattern[1:])
                self.names.add(pattern[2:])
            elif pattern:
                parsed = split_host(pattern)
                self.names.add(parsed[0] if parsed else pattern)
        bind = bind_host.strip().lower().strip("[]")
        self.bind_ip = _ip(bind)
        self.wildcard = bind in WILDCARD_HOSTS
        if self.wildcard:
            for name in (socket.gethostname(), socket.getfqdn()):
                if name:
                    self.names.add(name.lower().removesuffix("."))
        elif self.bind_ip is None:
            self.names.add(bind.removesuffix("."))  # --host some-name

    def allows(self, host: str) -> bool:
        if self.any:
            return True
        ip = _ip(host)
        if ip is not None:
            if self.wildcard:
                return True
            if self.bind_ip is None:  # bound by name: its addresses and loopback
                return True
            return ip == self.bind_ip or (ip.is_loopback and self.bind_ip.is_loopback)
        return host in self.names or any(host.endswith(s) for s in self.suffixes)


class OriginRule:
    """Which browser origins may call the server: its own (a page it serves, e.g. /docs) and the
    --cors-origin list ('*' for any). 'null' (sandboxed frames, file:// pages) only when listed."""

    def __init__(self, allowed: Iterable[str] = ()) -> None:
        self.origins = {normalize_origin(o) for o in allowed if o.strip()}
        self.any = "*" in self.origins

    def allows(self, origin: str, host: tuple[str, int | None] | None) -> bool:
        normal = normalize_origin(origin)
        if self.any or normal in self.origins:
            return True
        if host is None or normal == "null":
            return False
        parts = urlsplit(normal)
        default = _DEFAULT_PORTS.get(parts.scheme)
        try:
            origin_port = parts.port or default
        except ValueError:
            return False
        return parts.hostname == host[0] and origin_port == (host[1] or default)


def normalize_origin(origin: str) -> str:
    origin = origin.strip().lower().rstrip("/")
    parts = urlsplit(origin)
    if parts.scheme and parts.netloc:
        try:
            port = parts.port
        except ValueError:
            return origin
        netloc = parts.hostname or ""
        if ":" in netloc:
            netloc = f"[{netloc}]"
        if port is not None and port != _DEFAULT_PORTS.get(parts.scheme):
            netloc += f":{port}"
        return f"{parts.scheme}://{netloc}"
    return origin


async def _send_error(error: APIError, scope, receive, send, extra_headers: dict[str, str] | None = None) -> None:
    response = error.response()
    for k, v in (extra_headers or {}).items():
        response.headers[k] = v
    await response(scope, receive, send)


class Guard:
    """Outermost: metrics around everything; Host and Origin checks before anything else."""

    def __init__(self, app, *, metrics, hosts: HostRule, origins: OriginRule) -> None:
        self.app, self.metrics, self.hosts, self.origins = app, metrics, hosts, origins

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
            error = self.check(scope)
            if error is not None:
                await _send_error(error, scope, receive, send_status, {"Vary": "Origin"})
            else:
                await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.request_latency.labels(endpoint).observe(time.perf_counter() - t0)

    def check(self, scope) -> APIError | None:
        raw_host = _header(scope, b"host")
        host = None
        if raw_host is not None:  # none: an HTTP/1.0 client, never a browser
            host = split_host(raw_host.decode("latin-1"))
            if host is None or not self.hosts.allows(host[0]):
                shown = raw_host.decode("latin-1")[:100]
                return APIError(403, f"Requests for host '{shown}' are not served here (DNS-rebinding protection); "
                                     "start the server with --allowed-host NAME to serve that name.",
                                code="host_not_allowed")
        raw_origin = _header(scope, b"origin")
        if raw_origin is not None:
            origin = raw_origin.decode("latin-1")
            if not self.origins.allows(origin, host):
                shown = origin[:100]
                return APIError(403, f"Cross-origin requests from '{shown}' are not allowed; start the server with "
                                     f"--cors-origin {shown} to allow that web page.", code="origin_not_allowed")
        return None


class Gate:
    """Inside CORS: OPTIONS, the API key, the body (size, time, encoding, JSON content type)."""

    def __init__(self, app, *, api_key: str | Sequence[str] | None, max_body: int,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT, methods_for: Callable[[str], set[str]] | None = None) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
        self.api_keys = [key.encode() for key in keys if key]
        # each key's requests draft from their own suffix cache (a pool named without the key)
        self.pools = [f"key-{hashlib.sha256(key).hexdigest()[:16]}" for key in self.api_keys]
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.methods_for = methods_for

    def authorized(self, scope) -> str | None:
        """The pool of the key in `Authorization: Bearer KEY`, or None when it is none of the keys;
        the scheme is case-insensitive (RFC 9110), the key compared with every key in constant time."""
        given = _header(scope, b"authorization") or b""
        scheme, _, token = given.strip().partition(b" ")
        matches = [hmac.compare_digest(token.strip(), key) for key in self.api_keys]  # all of them: no timing
        if scheme.lower() != b"bearer" or not any(matches):
            return None
        return self.pools[matches.index(True)]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        keyed = path.startswith("/v1") or path == "/metrics"
        if keyed and self.api_keys:
            pool = self.authorized(scope)
            if pool is None:
                await _send_error(APIError(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"}), scope, receive, send)
                return
            scope.setdefault("state", {})["pool"] = pool  # request.state.pool: the suffix cache it reads and adds to
        if method == "OPTIONS" and self.methods_for is not None:  # not a CORS preflight (CORS answered those)
            methods = self.methods_for(path)
            if methods:
                allow = ", ".join(sorted(methods | {"OPTIONS"}))
                await _send_plain(send, 204, [(b"allow", allow.encode())])
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


async def _send_plain(send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
