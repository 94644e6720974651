"""Helpers shared by the tests that run the server (in a thread, or `localspec serve` as a subprocess)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadedServer:
    """uvicorn serving `app` in a thread on a free port (no signal handlers: not the main thread)."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive()


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
