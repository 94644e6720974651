"""Helpers shared by the tests that run the server (in a thread, or `localspec serve` as a subprocess)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx


_script = os.path.join(os.path.dirname(sys.executable), "localspec")
CLI = [_script] if os.path.exists(_script) else [sys.executable, "-m", "localspec.cli"]  # the installed command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadedServer:
    """`localspec serve`'s uvicorn server (localspec.server.app.Server) serving `app` in a thread on
    a free port (no signal handlers: not the main thread); `stop()` shuts it down as SIGTERM does."""

    def __init__(self, app, grace: float = 5.0) -> None:
        from localspec.server.app import Server

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = Server(app, host="127.0.0.1", port=self.port, grace=grace, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def stop(self, timeout: float = 15) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive()


@contextmanager
def cli_serve(*args: str) -> Iterator[dict]:
    """`localspec serve --port <free> *args` as a subprocess; yields {"proc", "port", "url", "ready"}
    at once (it loads while other tests run: `wait_ready` waits for it) and kills it afterwards."""
    port = free_port()
    proc = subprocess.Popen(CLI + ["serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    handle = {"proc": proc, "port": port, "url": f"http://127.0.0.1:{port}", "ready": False}
    yield handle
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=10)


def wait_ready(handle: dict, timeout: float = 90) -> str:
    """Wait until the server in `handle` ({"proc", "url", "ready"}) answers /health; its URL."""
    if not handle["ready"]:
        deadline = time.monotonic() + timeout
        while True:
            assert handle["proc"].poll() is None, handle["proc"].communicate()[1][-3000:]
            try:
                if httpx.get(handle["url"] + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "localspec serve did not come up"
            time.sleep(0.2)
        handle["ready"] = True
    return handle["url"]


class PacedEngine:
    """An engine double for the server's timing tests (shutdown, grace periods), where a real
    model's speed would make them slow or flaky: each step takes `step` seconds and emits one token
    (" 1,", " 2,", ...) until max_tokens, with running stats like the engine's. Nothing here is
    about generation; tests of what the engine answers use the real model."""

    def __init__(self, step: float = 0.02, n_ctx: int = 512) -> None:
        self.step = step
        self.n_ctx = n_ctx
        self.calls: list[dict] = []  # the options of every request that reached the engine

    def stream(self, prompt, *, max_tokens: int = 16, **options):
        from localspec.outputs import Chunk, Stats

        if not prompt:
            raise ValueError("the prompt is empty")
        self.calls.append(dict(options, max_tokens=max_tokens))

        def gen():
            stats = Stats(prompt_tokens=3, prompt_tokens_evaluated=3)
            for i in range(1, max_tokens + 1):
                time.sleep(self.step)
                stats.completion_tokens += 1
                stats.steps += 1
                yield Chunk(f" {i},", [i], finish_reason="length" if i == max_tokens else None, stats=stats)

        return gen()


def raw_http(port: int, request: bytes, timeout: float = 10) -> tuple[bytes, float]:
    """Send raw bytes, read until the server closes the connection: (response, seconds)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while True:
            try:
                part = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not part:
                break
            data += part
    return data, time.monotonic() - t0
