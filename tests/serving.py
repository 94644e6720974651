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
import numpy as np
from scripted import BOS_TEXT, EOS_TEXT, ScriptedContext, ScriptedModel


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


def counting_model(n: int = 4096):
    """A scripted model whose vocabulary is BOS, EOS and the pieces " 1,", " 2,", ... " n,", and
    whose logits count: after " i," comes " i+1,", after anything else " 1,"."""
    model = ScriptedModel([BOS_TEXT, EOS_TEXT] + [f" {i},".encode() for i in range(1, n + 1)], name="counting")

    def logits(history: tuple[int, ...]) -> np.ndarray:
        row = np.full(model.n_vocab, -100.0, dtype=np.float32)  # sampled or not, it counts
        last = history[-1]
        row[last + 1 if 2 <= last < model.n_vocab - 1 else 2] = 100.0
        return row

    return model, logits


class PacedContext(ScriptedContext):
    """A scripted context whose every pass takes `step` seconds of real time, and which fails a pass
    with RuntimeError once `fail_after` passes have run (None: never)."""

    def __init__(self, model, logits, *, step: float, fail_after: int | None = None, **kwargs) -> None:
        super().__init__(model, logits, **kwargs)
        self.step, self.fail_after, self.n_passes = step, fail_after, 0

    def decode_rows(self, rows):
        time.sleep(self.step)
        self.n_passes += 1
        if self.fail_after is not None and self.n_passes > self.fail_after:
            raise RuntimeError("secret detail mid-stream")
        return super().decode_rows(rows)


def paced_engine(step: float = 0.02, *, n_ctx: int = 4096, parallel: int = 1, fail: str | None = None):
    """The real engine (its scheduler, its worker path, its streams) over the counting model on a
    paced context: each pass takes `step` seconds, and a request's tokens count " 1, 2, 3," up to
    max_tokens, so the server's timing tests (shutdown, grace periods, time limits) neither wait
    on a real model's speed nor depend on it. `fail`: "start" fails every request as it is
    prepared (a RuntimeError: a server error, not a bad request), "mid" fails the second pass.
    `engine.prepared`: the GenerationOptions of every request the engine accepted; `engine.calls`: every
    request that took a slot (`engine.Request`)."""
    from localspec.runtime.engine import Engine
    from localspec.speculative.policy import FixedLength

    model, logits = counting_model()
    oracle = PacedContext(model, logits, n_ctx=n_ctx, n_seq=parallel, step=step,
                          fail_after=1 if fail == "mid" else None)

    class Paced(Engine):
        def prepare(self, prompt, options=None, **changes):
            if fail == "start":
                raise RuntimeError("secret detail at /home/user/model.gguf")
            seq = super().prepare(prompt, options, **changes)
            self.prepared.append(options)
            return seq

    engine = Paced.from_parts(oracle=oracle, policy=FixedLength(0))
    engine.calls, engine.prepared = [], []
    admit = engine.slots.admit

    def admitting(seq, free=(), busy=()):
        engine.calls.append(seq.request)
        return admit(seq, free, busy)

    engine.slots.admit = admitting
    return engine


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
