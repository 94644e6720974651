"""llama.cpp's RPC backend (`--rpc`, `rpc=`): endpoint parsing and the probe that runs before any
model loads, against real sockets; then, with the RPC build (scripts/build_rpc.sh: an RPC-enabled
llama-cpp-python in the cache, put first on a subprocess's PYTHONPATH, and rpc-server), the default
pair's oracle split over two rpc-servers on 127.0.0.1 gives the local oracle's greedy text, with and
without drafting.

The installed llama-cpp-python is usually built without RPC, so the tests that need it run localspec
in a subprocess on the private build. When that build is missing the `rpc_build` fixture runs the
build script (once: the cache keeps it; ~20-30 minutes on 2 cores), so no test is skipped for the
lack of it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from localspec.cli.commands import main
from localspec.llama.rpc import RPCError, parse_servers, probe, supports_rpc

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Write a haiku about the sea.", "List three primary colors.", "Explain what a CPU cache is in two sentences."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- no RPC build needed


def test_servers_are_parsed_and_checked():
    assert parse_servers("10.0.0.2:50052, gpu-box.lan:50053") == ("10.0.0.2:50052", "gpu-box.lan:50053")
    assert parse_servers(["a:1", "b:2,c:3"]) == ("a:1", "b:2", "c:3")
    assert parse_servers(None) == ()
    for bad in ("10.0.0.2", "host:0", "host:70000", "a:1,,b:2", "::1:50052", "a:1,a:1", "host:port", ""):
        with pytest.raises(ValueError):
            parse_servers(bad)


def test_an_unreachable_server_is_named():
    port = free_port()  # nothing listens there now
    with pytest.raises(RPCError, match=rf"RPC server 127\.0\.0\.1:{port} is unreachable"):
        probe(f"127.0.0.1:{port}", timeout=5)


class _Listener:
    """A real TCP server on loopback that is not an rpc-server: it says nothing, or `reply`."""

    def __init__(self, reply: bytes | None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.reply, self.conns = reply, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.reply is not None:
                conn.recv(1024)
                conn.sendall(self.reply)
                conn.close()

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def test_a_server_that_does_not_answer_the_handshake_is_named():
    """An rpc-server serves one client at a time: a second client's connection is accepted by the
    kernel and then waits. The probe says so instead of hanging (llama.cpp would wait forever)."""
    silent = _Listener(None)
    try:
        with pytest.raises(RPCError, match=rf"127\.0\.0\.1:{silent.port} accepted the connection but did not answer "
                                           r"within 0\.5 s: an rpc-server serves one client at a time"):
            probe(f"127.0.0.1:{silent.port}", timeout=0.5)
    finally:
        silent.close()


def test_a_server_that_is_not_an_rpc_server_is_named():
    web = _Listener(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    try:
        with pytest.raises(RPCError, match=rf"127\.0\.0\.1:{web.port} does not answer as an rpc-server"):
            probe(f"127.0.0.1:{web.port}", timeout=5)
    finally:
        web.close()


def test_rpc_is_checked_before_any_model_loads(tmp_path):
    """Without RPC in the loaded llama.cpp the error names the build command; with it, an unreachable
    server is named. Either way before the (here missing) oracle file is looked at."""
    from localspec.runtime.engine import Engine

    port = free_port()
    with pytest.raises(RPCError) as e:
        Engine(tmp_path / "missing.gguf", rpc=f"127.0.0.1:{port}", cost_cache=False)
    if supports_rpc():
        assert f"127.0.0.1:{port} is unreachable" in str(e.value)
    else:
        assert 'CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall' in str(e.value)
        assert "scripts/build_rpc.sh" in str(e.value) and "PYTHONPATH" in str(e.value)


def test_cli_options_take_servers_and_say_to_keep_them_private():
    runner = CliRunner()
    result = runner.invoke(main, ["generate", "hi", "--rpc", "nocolon"])
    assert result.exit_code == 2 and "Invalid value for '--rpc'" in result.output
    result = runner.invoke(main, ["generate", "hi", "--draft-rpc", "a:1,a:1"])
    assert result.exit_code == 2 and "listed twice" in result.output
    for command in ("generate", "chat", "serve", "check"):
        help_text = " ".join(runner.invoke(main, [command, "--help"], terminal_width=200).output.split())
        assert "--rpc HOST:PORT" in help_text and "--draft-rpc" in help_text
        assert "no authentication" in help_text and "trusted network only" in help_text


# ---------------------------------------------------------------- with the RPC build


@pytest.fixture(scope="session")
def rpc_build() -> Path:
    """The RPC build (scripts/build_rpc.sh; reused from the cache once built): its directory."""
    script = ROOT / "scripts" / "build_rpc.sh"
    p = subprocess.run(["bash", str(script)], env={**os.environ, "PYTHON": sys.executable},
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.fail(f"{script} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    build = Path(p.stdout.strip().splitlines()[-1])
    assert (build / "bin" / "rpc-server").is_file()
    return build


@pytest.fixture(scope="session")
def rpc_env(rpc_build) -> dict:
    """The environment of a localspec subprocess on the RPC-enabled llama_cpp."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(rpc_build / "site"), str(ROOT)])}
    env[RPC_TIMEOUT] = "600"  # a paused machine must not read as a dead server
    check = subprocess.run([sys.executable, "-c", "import llama_cpp, sys; print(llama_cpp.__file__); "
                            "sys.exit(0 if llama_cpp.llama_supports_rpc() else 3)"],
                           env=env, capture_output=True, text=True)
    assert check.returncode == 0, f"the RPC build's llama_cpp does not support RPC: {check.stdout}{check.stderr}"
    assert check.stdout.startswith(str(rpc_build / "site"))
    return env


RPC_TIMEOUT = "LOCALSPEC_RPC_TIMEOUT"


@pytest.fixture(scope="module")
def rpc_servers(rpc_build, tmp_path_factory):
    """Two rpc-servers on 127.0.0.1 (one thread each): HOST:PORT of each."""
    logs = tmp_path_factory.mktemp("rpc-server")
    procs, endpoints = [], []
    try:
        for i in range(2):
            port = free_port()
            log = open(logs / f"server{i}.log", "wb")
            procs.append(subprocess.Popen([str(rpc_build / "bin" / "rpc-server"), "-H", "127.0.0.1", "-p", str(port),
                                           "-t", "1"], stdout=log, stderr=subprocess.STDOUT))
            endpoints.append(f"127.0.0.1:{port}")
        for proc, endpoint, i in zip(procs, endpoints, range(2)):
            port = int(endpoint.rsplit(":", 1)[1])
            while True:  # until it listens (or dies): no deadline of our own, the machine may be paused
                if proc.poll() is not None:
                    pytest.fail(f"rpc-server exited ({proc.returncode}): {(logs / f'server{i}.log').read_text()}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=60).close()
                    break
                except OSError:
                    threading.Event().wait(0.1)
        yield endpoints
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _agree(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


@pytest.mark.model
def test_the_oracle_split_over_two_rpc_servers_gives_the_local_oracles_text(rpc_env, rpc_servers, pair_paths):
    oracle, draft = map(str, pair_paths)
    args = {"oracle": oracle, "draft": draft, "servers": rpc_servers, "prompts": PROMPTS, "max_tokens": 32}
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "rpc_worker.py"), json.dumps(args)], env=rpc_env,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    print("seconds per run (local, split, split + draft, remote draft):", out["timings"])
    assert out["supports_rpc"]

    # the layers really are split: some here, some on each server (llama.cpp's own load log agrees)
    layers = dict(out["placement"]["layers"])
    assert sum(layers.values()) == out["placement"]["n_layer"] + 1
    assert out["placement"]["devices"] == rpc_servers
    assert layers["this machine's CPU"] > 0
    for i, endpoint in enumerate(rpc_servers):
        assert layers[f"RPC{i} ({endpoint})"] > 0
        assert any(f"[{endpoint}] model buffer size" in line for line in out["load_log"]), out["load_log"]
    assert any("oracle layers:" in line and rpc_servers[1] in line for line in out["progress"])

    # flash attention "auto" goes by this machine's GPUs, not by llama.cpp's offload support (which an
    # RPC build reports even on a CPU-only machine): off here without one
    assert out["supports_gpu_offload"]
    assert out["flash_attn"] == ("on" if out["local_gpus"] else "off")

    # the same kernels on both sides: the split oracle's logits are the local oracle's (bitwise, here)
    assert out["logit_max_abs_diff"] < 1e-3

    local = out["local"]["tokens"]
    assert out["local"]["drafted"] == 0 and out["rpc_plain"]["drafted"] == 0
    assert _agree(out["rpc_plain"]["tokens"], local) >= len(PROMPTS) - 1
    for run in ("rpc_spec", "draft_rpc_spec"):
        spec = out[run]
        assert spec["drafted"] > 0 and spec["accepted"] > 0, run
        # exact: every emitted token is the (split) oracle's argmax at the position it was verified
        for argmax, emitted in spec["steps"]:
            assert emitted == argmax, run
        # and the text is the local oracle's (a near-tie in batched logits may rarely send one prompt elsewhere)
        assert _agree(spec["tokens"], local) >= len(PROMPTS) - 1, run

    # the draft evaluates the prompt itself: copying a cache over RPC goes a row at a time
    assert not out["split_copies_cache"] and not out["remote_draft_copies_cache"]

    five = dict(map(tuple, out["five_layers"]))
    assert five["this machine's CPU"] == out["placement"]["n_layer"] + 1 - 5
    assert sum(n for where, n in five.items() if where != "this machine's CPU") == 5

    # --draft-rpc: the draft over the server, the oracle here
    assert out["oracle_local"]
    assert any(f"({rpc_servers[1]})" in where and n > 0 for where, n in out["draft_placement"])


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localspec.cli", *args], env=env, capture_output=True, text=True)


@pytest.mark.model
def test_cli_generate_over_rpc(rpc_env, rpc_servers):
    common = ["generate", PROMPTS[0], "--max-tokens", "24", "--json", "--draft-length", "4"]
    split = _cli(rpc_env, *common, "--rpc", ",".join(rpc_servers))
    assert split.returncode == 0, split.stderr
    assert "oracle layers:" in split.stderr and rpc_servers[0] in split.stderr and rpc_servers[1] in split.stderr
    here = _cli(rpc_env, *common, "--no-draft")
    assert here.returncode == 0, here.stderr
    a, b = json.loads(split.stdout), json.loads(here.stdout)
    assert a["stats"]["drafted"] > 0
    assert a["text"] == b["text"]


@pytest.mark.model
def test_cli_names_the_unreachable_server_before_loading(rpc_env, rpc_servers):
    dead = f"127.0.0.1:{free_port()}"
    p = _cli(rpc_env, "generate", "hi", "--max-tokens", "4", "--rpc", f"{rpc_servers[0]},{dead}")
    assert p.returncode == 2
    assert f"RPC server {dead} is unreachable" in p.stderr
    assert "layers:" not in p.stderr  # nothing was loaded


@pytest.mark.model
def test_a_busy_rpc_server_is_named(rpc_env, rpc_servers, pair_paths):
    """rpc-server serves one client at a time: while a process holds it, another is told so."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from localspec.runtime.engine import Engine; "
         f"e = Engine({str(pair_paths[1])!r}, rpc={rpc_servers[0]!r}, cost_cache=False); "
         "print('loaded', flush=True); sys.stdin.read(); e.close()"],
        env=rpc_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "loaded", holder.stderr.read()
        p = _cli({**rpc_env, RPC_TIMEOUT: "1"}, "generate", "hi", "--max-tokens", "4", "--rpc", rpc_servers[0])
        assert p.returncode == 2
        assert f"RPC server {rpc_servers[0]} accepted the connection but did not answer within 1 s" in p.stderr
    finally:
        holder.stdin.close()
        holder.wait()
