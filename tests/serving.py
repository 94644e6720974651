"""Helpers shared by the tests that start `localspec serve` as a subprocess."""

from __future__ import annotations

import time

import httpx


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
