"""Reliability and security: bad models, bad requests, a full context, load, faults, the API key,
model names that are paths, and a batch run killed mid-way. What tests/test_server.py,
tests/test_chat_cli.py and tests/test_batch.py already cover is not repeated here.

One small in-process server (n_ctx 256, one thread) for the request tests, and one real
`localspec serve` subprocess (started first, loading while the rest runs) for RSS and SIGTERM."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from localspec.llama.context import ModelLoadError
from localspec.options import GenerationOptions
from serving import CLI, ThreadedServer, cli_serve, free_port, raw_http, wait_ready

MODEL = "smollm2"
N_CTX = 256
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
MARKER = "okapi-lantern-marker"  # prompt text that must never reach a log

def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cli_server(pair_paths):
    """`localspec serve` with its default host and one slot, loading while the other tests run."""
    with cli_serve("--ctx", str(N_CTX), "--threads", "1", "--parallel", "1", "--max-queue", "4",
                   "--shutdown-grace", "1") as handle:
        yield handle


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, pair_paths):
    """Broken models made from the real Q4_1 draft."""
    good = Path(pair_paths[1])
    d = tmp_path_factory.mktemp("badmodels")
    data = good.read_bytes()
    files = {"directory": d / "dir.gguf", "not_gguf": d / "notes.gguf", "truncated": d / "head.gguf",
             "truncated_data": d / "half.gguf", "corrupt": d / "corrupt.gguf", "unknown_arch": d / "arch.gguf",
             "no_template": d / "notemplate.gguf"}
    files["directory"].mkdir()
    files["not_gguf"].write_text("this is not a model\n")
    files["truncated"].write_bytes(data[:1_000_000])
    files["truncated_data"].write_bytes(data[:len(data) * 6 // 10])
    files["corrupt"].write_bytes(b"GGUF" + os.urandom(200_000))
    key = b"general.architecture"  # value: a string, "llama"; same length, so nothing shifts
    i = data.index(key) + len(key) + 4 + 8
    assert data[i:i + 5] == b"llama"
    files["unknown_arch"].write_bytes(data[:i] + b"lxxma" + data[i + 5:])
    key = b"tokenizer.chat_template"
    assert data.count(key) == 1
    files["no_template"].write_bytes(data.replace(key, b"tokenizer.chat_templatX"))
    return files


class CappedEngine:
    """The real engine, every request capped at a few tokens (the fuzzer asks for millions)."""

    def __init__(self, engine, cap: int = 3) -> None:
        self._engine, self._cap = engine, cap
        self.fail_on: str | None = None

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def prepare(self, prompt, options=None, *, tools=None, pool="", **changes):
        if self.fail_on and self.fail_on in json.dumps(prompt):
            raise RuntimeError("injected engine fault")
        options = GenerationOptions.build(options, **changes)
        return self._engine.prepare(prompt, options, tools=tools, pool=pool,
                                    max_tokens=min(options.max_tokens, self._cap))


@pytest.fixture(scope="module")
def small_engine(pair_paths, cli_server):
    from localspec.runtime.engine import Engine

    oracle, draft = pair_paths
    with Engine(oracle, draft, n_ctx=N_CTX, n_threads=1, draft_length=4) as e:
        yield e


@pytest.fixture(scope="module")
def worker(small_engine):
    from localspec.server import EngineWorker

    w = EngineWorker(small_engine, max_queue=8)
    yield w
    w.close()


@pytest.fixture(scope="module")
def app(worker, registry):
    from localspec.server import create_app

    return create_app(worker, model_name=MODEL, aliases=[registry.pair(None).oracle])  # the default max body


@pytest.fixture(scope="module")
def server(app):
    s = ThreadedServer(app)
    yield s.url
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


# ---------------------------------------------------------------- 1. bad models


@pytest.mark.model
@pytest.mark.parametrize("kind, message", [
    ("directory", "not a file"), ("not_gguf", "not a GGUF file"), ("truncated", "corrupt or truncated GGUF"),
    ("truncated_data", "tensor data ends past the end of the file"), ("corrupt", "unsupported version"),
    ("unknown_arch", "unknown model architecture"),
])
def test_broken_model_files_are_a_model_load_error(bad_files, kind, message, caplog):
    from localspec.llama.context import LlamaModel

    with caplog.at_level(logging.WARNING, logger="localspec"):
        with pytest.raises(ModelLoadError, match=message):
            LlamaModel(bad_files[kind])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # llama.cpp's lines are in the message


def one_line_error(p: subprocess.CompletedProcess | tuple, *needles: str) -> None:
    rc, out, err = p
    assert rc == 2, err
    assert "Traceback" not in err and "Segmentation" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("localspec: error:"), err
    for needle in needles:
        assert needle in lines[0], err


@pytest.mark.model
def test_cli_and_server_refuse_bad_models_in_one_line(bad_files, registry, tmp_path):
    """Every command in parallel (the machine is small): generate and serve, broken files,
    incompatible vocabularies; plus a draft larger than its oracle, which only warns."""
    common = ["--threads", "1", "--ctx", "128"]
    port = str(free_port())
    runs = {
        **{f"generate-{k}": ["generate", "hi", "--oracle", str(bad_files[k]), "--no-draft", *common]
           for k in ("truncated_data", "corrupt", "unknown_arch")},
        "generate-bad-draft": ["generate", "hi", "--draft", str(bad_files["truncated_data"]), *common],
        "serve-truncated": ["serve", "--port", port, "--oracle", str(bad_files["truncated"]), "--no-draft", *common],
        "serve-incompatible": ["serve", "--port", port, "--draft", "gemma-3-270m-q4_k_m", *common],
        "generate-big-draft": ["generate", "hi", "--oracle", "smollm2-135m-instruct-q4_1", "--draft",
                               "smollm2-135m-instruct-f32", "--max-tokens", "2", *common],
    }
    procs = {name: subprocess.Popen(CLI + args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, args in runs.items()}
    results = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=120)
        results[name] = (p.returncode, out, err)
    one_line_error(results["generate-truncated_data"], "tensor data ends past the end")
    one_line_error(results["generate-bad-draft"], "tensor data ends past the end")
    one_line_error(results["generate-corrupt"], "unsupported version")
    one_line_error(results["generate-unknown_arch"], "unknown model architecture")
    one_line_error(results["serve-truncated"], "corrupt or truncated GGUF")
    one_line_error(results["serve-incompatible"], "cannot draft for oracle")
    for name in ("serve-truncated", "serve-incompatible"):
        assert "Uvicorn running" not in results[name][2]  # refused before listening
    rc, out, err = results["generate-big-draft"]
    assert rc == 0 and out.strip(), err
    warnings = [line for line in err.splitlines() if "not smaller than the oracle" in line]
    assert len(warnings) == 1 and "Traceback" not in err, err


@pytest.mark.model
def test_a_model_without_a_chat_template_warns_once(bad_files, caplog):
    from localspec.runtime.engine import Engine

    with Engine(bad_files["no_template"], None, n_ctx=128, n_threads=1) as e:
        assert not e.oracle_model.chat_template
        with caplog.at_level(logging.WARNING, logger="localspec.runtime.engine"):
            text = e.render(chat("Hi"))
            e.render(chat("Hello"))
            e.generate(chat("Hey"), max_tokens=1)
    assert text.startswith("<|im_start|>user\nHi<|im_end|>")  # the ChatML fallback
    warned = [r for r in caplog.records if "no chat template" in r.getMessage()]
    assert len(warned) == 1


@pytest.mark.model
def test_a_draft_larger_than_the_oracle_warns_at_start(registry, caplog):
    from localspec.runtime.engine import Engine

    with caplog.at_level(logging.WARNING, logger="localspec.runtime.engine"):
        with Engine("smollm2-135m-instruct-q4_1", "smollm2-135m-instruct-f32", n_ctx=64, n_threads=1):
            pass
        with Engine("smollm2-135m-instruct-f32", "smollm2-135m-instruct-q4_1", n_ctx=64, n_threads=1):
            pass  # the usual way round: no warning
    warned = [r for r in caplog.records if "not smaller than the oracle" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0].getMessage()


# ---------------------------------------------------------------- 2. bad requests


BAD_BODIES = [
    ("/v1/chat/completions", {"messages": chat("Hi"), "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": "Hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 42}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [None]}, "messages"),
    ("/v1/chat/completions", {"messages": chat("Hi"), "max_tokens": 1, "stream": [1]}, "stream"),
    ("/v1/chat/completions", {"messages": chat("Hi"), "max_tokens": 1, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": chat("Hi"), "seed": 1.5}, "seed"),
    ("/v1/chat/completions", {"messages": chat("Hi"), "stop": [1, 2]}, "stop"),
    ("/v1/completions", {"prompt": 42}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1e400}, "max_tokens"),
]


@pytest.mark.model
@pytest.mark.parametrize("path, body, param", BAD_BODIES, ids=[f"{p[4:]}-{param}-{i}" for i, (p, _, param) in enumerate(BAD_BODIES)])
def test_wrong_types_and_values_are_400(http, path, body, param):
    content = json.dumps(body).replace("1e+400", "1e400").encode()
    err = error_of(http.post(path, content=content, headers={"content-type": "application/json"}), 400)
    assert err["type"] == "invalid_request_error" and (err["param"] or "").startswith(param), err


@pytest.mark.model
@pytest.mark.parametrize("content", [b"null", b'"a string"', b"42", b"", b"\xff\xfe{}",
                                     b'{"messages": [{"role": "user", "content": "\xff\xfe bad"}]}',
                                     b'{"prompt": "Hi", "max_tokens": 2}\x00garbage', b"{" * 10000])
def test_malformed_bodies_are_400(http, content):
    r = http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    error_of(r, 400)


@pytest.mark.model
def test_ten_megabyte_bodies_are_413(http):
    big = json.dumps({"model": MODEL, "messages": chat("x" * 10_000_000)}).encode()
    assert error_of(http.post("/v1/chat/completions", content=big), 413)["code"] == "request_too_large"

    def chunked():
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    error_of(http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"}), 413)
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200


@pytest.mark.model
def test_odd_but_valid_requests_are_answered(http):
    for body in ({"prompt": "", "max_tokens": 1}, {"prompt": [""], "max_tokens": 1}):
        assert http.post("/v1/completions", json=body).status_code in (200, 400)
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ""}], "max_tokens": 1})
    assert r.status_code == 200
    r = http.post("/v1/chat/completions", json={"messages": chat("é 漢字 🙂 \u0000 \ud7ff"), "max_tokens": 1})
    assert r.status_code == 200


def test_schemathesis_is_in_the_test_extra():
    text = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert "schemathesis" in text.split("[project.optional-dependencies]")[1].split("bench =")[0]


@pytest.mark.model
def test_fuzz_the_openapi_schema(worker, registry):
    """schemathesis generates requests from /openapi.json (valid and invalid), in-process (ASGI),
    against the real engine, each generation capped at 3 tokens: never a 5xx."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, settings

    from localspec.server import EngineWorker, create_app

    capped = EngineWorker(CappedEngine(worker.engine), max_queue=8)
    try:
        fuzz_app = create_app(capped, model_name=MODEL, aliases=[registry.pair(None).oracle],
                              allowed_hosts=["testserver"])  # the Host schemathesis's ASGI client sends
        schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
        failures, calls = [], []
        t0 = time.monotonic()
        for operation in schema.get_all_operations():
            op = operation.ok()

            @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def run(case):
                response = case.call()
                calls.append((op.path, response.status_code))
                if response.status_code >= 500:
                    failures.append((op.method, op.path, case.body, response.status_code, response.text[:300]))

            op.as_strategy()  # fails early on a schema it cannot read
            from hypothesis import given

            given(op.as_strategy())(run)()
        assert not failures, failures[:5]
        print(len(calls), "fuzzed calls", sorted({(p, c) for p, c in calls}))
        assert len(calls) >= 60 and {p for p, _ in calls} >= {"/v1/chat/completions", "/v1/completions"}
        assert any(c == 200 for p, c in calls if p == "/v1/chat/completions")  # it reached the engine too
        assert time.monotonic() - t0 < 120
    finally:
        capped.close()


# ---------------------------------------------------------------- 3. a full context


@pytest.mark.model
def test_context_exhaustion_mid_generation_finishes_with_length(http):
    r = http.post("/v1/completions", json={"prompt": COUNTING * 7, "max_tokens": 10 ** 30, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    u = body["usage"]
    assert u["completion_tokens"] > 0 and u["prompt_tokens"] + u["completion_tokens"] <= N_CTX + 1

    with http.stream("POST", "/v1/completions",  # streamed; the same prompt, so its prefill is cached
                     json={"prompt": COUNTING * 7, "max_tokens": 10 ** 6, "temperature": 0, "stream": True}) as s:
        assert s.status_code == 200
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]] == ["length"]

    r = http.post("/v1/chat/completions", json={"messages": chat("Say hi."), "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# ---------------------------------------------------------------- 4. load


@pytest.mark.model
def test_32_concurrent_clients_all_answered(server, worker):
    statuses: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        try:
            with httpx.Client(base_url=server, timeout=60) as c:
                for j in range(3):
                    body = {"prompt": f"Client {i} request {j}:", "max_tokens": 1 + (i + j) % 2, "temperature": 0}
                    if (i + j) % 3 == 0:
                        body["stream"] = True
                    r = c.post("/v1/completions", json=body)
                    r.read()
                    assert r.status_code != 429 or int(r.headers["Retry-After"]) >= 1
                    with lock:
                        statuses.append(r.status_code)
        except BaseException as e:  # noqa: BLE001 - reported below
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(32)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, 120 - (time.monotonic() - t0)))
    assert not any(t.is_alive() for t in threads), "a client hung: deadlock?"
    assert not errors, errors[:3]
    assert len(statuses) == 96 and set(statuses) <= {200, 429} and statuses.count(200) >= 8, statuses
    deadline = time.monotonic() + 5
    while worker.busy or worker.queue_depth:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert httpx.get(server + "/health").json()["status"] == "ok"


@pytest.fixture(scope="module")
def eight_slots(pair_paths):
    """A server of eight slots over the default pair (draft model and prompt lookup), for load."""
    from localspec.runtime.engine import Engine
    from localspec.server import EngineWorker, create_app

    oracle, draft = pair_paths
    with Engine(oracle, draft, n_ctx=N_CTX, n_threads=2, parallel=8) as engine:
        worker = EngineWorker(engine, max_queue=32)
        server = ThreadedServer(create_app(worker, model_name=MODEL))
        try:
            yield server.url, worker
        finally:
            server.stop()
            worker.close()


@pytest.mark.model
def test_eight_slots_and_32_streaming_clients(eight_slots):
    """32 clients stream at once into eight slots and a queue of 32: no 5xx, every stream ends with
    a finish_reason and [DONE], and passes carried several sequences."""
    url, worker = eight_slots
    results: list = [None] * 32

    def client(i: int) -> None:
        body = {"prompt": f"Client {i}: tell me about the number {i}.", "max_tokens": 12, "stream": True,
                "temperature": 0 if i % 2 else 0.8}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
                results[i] = (r.status_code, events)
        except BaseException as e:  # noqa: BLE001 - reported below
            results[i] = (None, repr(e))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert all(r is not None and r[0] == 200 for r in results), [r for r in results if r is None or r[0] != 200][:3]
    for status, events in results:
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    metrics = httpx.get(url + "/metrics").text
    assert "localspec_slots 8.0" in metrics
    bigger = [line for line in metrics.splitlines() if line.startswith('localspec_pass_sequences_bucket{le="1.0"}')]
    total = [line for line in metrics.splitlines() if line.startswith("localspec_pass_sequences_count")]
    assert float(bigger[0].split()[-1]) < float(total[0].split()[-1])  # some passes carried several sequences


@pytest.mark.model
def test_twenty_clients_that_leave_mid_stream_free_their_slots(eight_slots):
    url, worker = eight_slots

    def leave(i: int) -> None:
        body = {"prompt": f"Count to one thousand, client {i}: 1, 2, 3,", "max_tokens": 200, "stream": True,
                "temperature": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    return  # the first chunk, then the client goes away

    threads = [threading.Thread(target=leave, args=(i,), daemon=True) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    deadline = time.monotonic() + 10
    while worker.busy or worker.queue_depth:
        assert time.monotonic() < deadline, (worker.running, worker.queue_depth)
        time.sleep(0.02)
    assert worker.scheduler.busy_slots == 0
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


@pytest.mark.model
def test_server_rss_is_flat_across_300_requests(cli_server):
    url = wait_ready(cli_server)
    pid = cli_server["proc"].pid
    with httpx.Client(base_url=url, timeout=60) as c:
        def burst(n: int, start: int) -> None:
            for i in range(start, start + n):  # the same short prompts: prefix reuse keeps each one cheap
                body = {"prompt": "Item:", "max_tokens": 1 + i % 2, "stream": i % 4 == 1, "temperature": 0}
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert time.monotonic() - t0 < 150, f"too slow: {i - start} requests"

        t0 = time.monotonic()
        burst(30, 0)  # warm-up: allocator pools, caches, lazily built things
        before = rss_kb(pid)
        burst(300, 40)
        after = rss_kb(pid)
    assert after < before * 1.05, (before, after)
    assert time.monotonic() - t0 < 120


@pytest.mark.model
def test_clients_that_leave_while_queued_or_waiting_free_the_engine(server, worker):
    """Disconnects without streaming: a queued client that gives up never runs, and a client
    that gives up on a running non-streamed request stops it within a step or so."""
    cancelled = worker.cancelled
    long_body = {"prompt": COUNTING, "max_tokens": 10 ** 6, "temperature": 0}  # clamped to half the context
    done = threading.Event()

    def give_up(body: dict, after: float) -> None:
        try:
            httpx.post(server + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=after))
        except httpx.ReadTimeout:
            pass  # the client closes its connection
        finally:
            done.set()

    running = threading.Thread(target=give_up, args=(long_body, 1.0), daemon=True)
    running.start()
    deadline = time.monotonic() + 20
    while not worker.busy:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    queued = threading.Thread(target=give_up, args=({"prompt": "never runs", "max_tokens": 50}, 0.3), daemon=True)
    queued.start()
    running.join(20)
    queued.join(20)
    while worker.cancelled < cancelled + 2 or worker.busy or worker.queue_depth:
        assert time.monotonic() < deadline, (worker.cancelled - cancelled, worker.busy, worker.queue_depth)
        time.sleep(0.02)
    t0 = time.monotonic()
    r = httpx.post(server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0}, timeout=30)
    assert r.status_code == 200 and time.monotonic() - t0 < 10


HOSTILE = [
    ("a host name rebound to us", b"POST /v1/completions HTTP/1.1\r\nHost: evil.example\r\n", 403),
    ("a cross-site form", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.example\r\n"
                          b"Content-Type: text/plain\r\n", 403),
    ("a sandboxed frame", b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nOrigin: null\r\n", 403),
    ("two hosts", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n", 400),
    ("a negative length", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -5\r\n", 400),
    ("a length that is not a number", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1e3\r\n", 400),
    ("two different lengths", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n"
                              b"Content-Length: 50\r\n", 400),
    ("chunked and a length (smuggling)", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                         b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\nConnection: close\r\n\r\n"
                                         b"5\r\nhello\r\n0\r\n\r\nGET /v1/models HTTP/1.1\r\n\r\n", 400),
    ("a NUL in a header", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: a\x00b\r\n", 400),
    ("a 100 KB header", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 100_000 + b"\r\n", None),
    ("a garbage request line", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 TLS hello\r\n", 400),
    ("a bearer key in latin-1", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xe9\xff\r\n",
     200),
]


@pytest.mark.model
@pytest.mark.parametrize("name, head, status", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_headers_are_refused_cleanly(server, worker, name, head, status):
    """Raw requests with hostile or malformed headers: refused with a 4xx (an OpenAI error body
    when it is localspec's refusal; uvicorn's parser refuses what is not HTTP) and nothing
    generated, or (status None: odd but harmless) answered; never a 5xx; the server answers
    afterwards."""
    port = int(server.rsplit(":", 1)[1])
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    completed = worker.completed
    data = head
    if b"\r\n\r\n" not in head:  # else: a whole request as it stands
        if b"Content-Length" not in head:
            data += b"Content-Length: %d\r\n" % len(body)
        data += b"Connection: close\r\n\r\n" + body
    t0 = time.monotonic()
    response, _ = raw_http(port, data)
    assert time.monotonic() - t0 < 5, "the server neither answered nor closed the connection"
    if status is None:
        assert response.startswith((b"HTTP/1.1 200", b"HTTP/1.1 4")), response[:300]
    elif status == 200:
        assert response.startswith(b"HTTP/1.1 200"), response[:300]
    else:
        got = int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else None
        assert got is None or 400 <= got < 500, response[:300]  # a bare close is fine for garbage
        if status == 403:
            assert got == 403 and b'"code":"' in response and b"not_allowed" in response, response[:500]
        assert worker.completed == completed, name  # nothing ran
    assert httpx.get(server + "/health", timeout=10).json()["status"] == "ok"


# ---------------------------------------------------------------- 5. faults


@pytest.mark.model
def test_an_exception_in_one_request_leaves_the_server_up(server, http, worker, caplog, monkeypatch):
    engine = worker.engine
    real_prepare = engine.prepare

    def prepare(prompt, options=None, **changes):
        if "boom" in json.dumps(prompt):
            raise RuntimeError("injected engine fault")
        return real_prepare(prompt, options, **changes)

    monkeypatch.setattr(engine, "prepare", prepare)
    with caplog.at_level(logging.DEBUG):
        for path, body in (("/v1/chat/completions", {"messages": chat(f"boom {MARKER}")}),
                           ("/v1/completions", {"prompt": f"boom {MARKER}", "stream": True})):
            r = http.post(path, json={**body, "max_tokens": 2})
            err = error_of(r, 500)
            assert err["type"] == "server_error" and "injected" not in r.text
        r = http.post("/v1/completions", json={"prompt": f"{MARKER} " * 400, "max_tokens": 2})
        assert error_of(r, 400)["code"] == "context_length_exceeded"
    assert "injected engine fault" in caplog.text  # the fault is logged...
    assert MARKER not in caplog.text  # ...and no prompt text with it
    assert worker.alive and http.get("/health").json()["status"] == "ok"
    r = http.post("/v1/chat/completions", json={"messages": chat("Say hi."), "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


# ---------------------------------------------------------------- 6. security


def test_serve_binds_127_0_0_1_by_default():
    from localspec.cli.commands import main

    host = next(p for p in main.commands["serve"].params if p.name == "host")
    assert host.default == "127.0.0.1"
    from localspec.server.app import run_server
    import inspect

    assert inspect.signature(run_server).parameters["host"].default == "127.0.0.1"


@pytest.mark.model
def test_the_real_server_listens_on_loopback_only(cli_server):
    wait_ready(cli_server)
    port = cli_server["port"]
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.split(":")
                if int(p, 16) == port and state == "0A":  # LISTEN
                    listening.append(addr)
    assert listening == ["0100007F"], listening  # 127.0.0.1 only, no IPv6 / wildcard socket


@pytest.mark.model
def test_api_key_on_every_v1_route_with_a_constant_time_compare(worker, monkeypatch):
    from starlette.testclient import TestClient

    import localspec.server.gate as gate_module
    from localspec.server import create_app

    compared = []
    real = gate_module.hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(gate_module.hmac, "compare_digest", spy)
    key = "k3y-" + "x" * 20
    keyed = create_app(worker, model_name=MODEL, api_key=key)
    routes = [(path, method.upper()) for path, ops in keyed.openapi()["paths"].items() if path.startswith("/v1")
              for method in ops]
    assert len(routes) >= 4
    bodies = {"/v1/chat/completions": {"messages": chat("Hi"), "max_tokens": 1},
              "/v1/completions": {"prompt": "Hi", "max_tokens": 1}}
    with TestClient(keyed, base_url="http://localhost") as c:
        for path, method in routes:
            path = path.replace("{model_id}", MODEL)
            kw = {"json": bodies.get(path)} if method == "POST" else {}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key},
                            {"Authorization": f"Bearer {key}x"}, {"Authorization": f"Basic {key}"}):
                assert c.request(method, path, headers=headers, **kw).status_code == 401, (path, headers)
            for scheme in ("Bearer", "bearer"):  # the scheme is case-insensitive (RFC 9110)
                r = c.request(method, path, headers={"Authorization": f"{scheme} {key}"}, **kw)
                assert r.status_code == 200, (path, r.text)
        assert c.get("/v1/no-such-route").status_code == 401  # unknown /v1 paths too: nothing is revealed
        assert c.get("/metrics").status_code == 401  # /metrics too (Prometheus sends the key as a bearer token)
        assert c.get("/health").status_code == 200
    assert compared and all(b == key.encode() for _, b in compared)


@pytest.mark.model
def test_a_model_name_is_never_a_path(http, pair_paths, monkeypatch):
    import localspec.runtime.engine
    import localspec.llama.context
    import localspec.models

    def forbidden(*a, **k):
        raise AssertionError("a request made the server load or resolve a model")

    monkeypatch.setattr(localspec.llama.context.LlamaModel, "__init__", forbidden)
    monkeypatch.setattr(localspec.runtime.engine.LlamaModel, "__init__", forbidden)
    monkeypatch.setattr(localspec.models.Registry, "resolve", forbidden)
    for name in ("/etc/passwd", str(pair_paths[0]), str(pair_paths[1]), "../../../../etc/passwd",
                 "file:///etc/passwd", "smollm2-135m-instruct-q4_1", "gemma-3-270m-q4_k_m", "smollm2-q2k"):
        err = error_of(http.post("/v1/chat/completions", json={"model": name, "messages": chat("Hi"), "max_tokens": 1}),
                       404)
        assert err["code"] == "model_not_found"
        error_of(http.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 1}), 404)
    error_of(http.get("/v1/models/etc/passwd"), 404)
    error_of(http.get("/v1/models/" + str(pair_paths[1]).lstrip("/")), 404)


# ---------------------------------------------------------------- 5b. SIGTERM with work in flight (runs last: stops the server)


@pytest.mark.model
def test_sigterm_with_a_running_request_and_a_queue(cli_server):
    """The issue's probe on the real command: one non-streamed generation running and four
    queued (one of them a stream), then SIGTERM. The queued ones get a prompt 503 with an OpenAI
    error body and Retry-After; the running one finishes within --shutdown-grace (1 s here) or
    ends with a 503 error body; the process exits 0 without a traceback or a CancelledError, and
    without blaming the client."""
    url = wait_ready(cli_server)
    proc = cli_server["proc"]
    results: dict[int, tuple] = {}

    def post(i: int, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                raw = r.read()
                results[i] = (r.status_code, r.headers.get("content-type", ""), raw, dict(r.headers), time.monotonic())
        except httpx.HTTPError as e:
            results[i] = (None, "", repr(e).encode(), {}, time.monotonic())

    long_body = {"prompt": f"{MARKER} {COUNTING}", "max_tokens": 10 ** 6, "temperature": 0}  # clamped to the limit
    threads = [threading.Thread(target=post, args=(0, long_body), daemon=True)]
    threads[0].start()
    deadline = time.monotonic() + 30
    while not httpx.get(url + "/health").json()["busy"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for i in range(1, 5):
        body = {"prompt": f"queued {i}", "max_tokens": 4, "stream": i == 4}
        threads.append(threading.Thread(target=post, args=(i, body), daemon=True))
        threads[-1].start()
    while httpx.get(url + "/health").json()["queue_depth"] < 4:
        assert time.monotonic() < deadline and 0 not in results, results.get(0)
        time.sleep(0.01)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert time.monotonic() - t0 < 10
    for t in threads:
        t.join(10)
    for i in range(1, 5):
        status, ctype, raw, headers, at = results[i]
        assert status == 503 and ctype.startswith("application/json"), (i, status, raw[:300])
        assert json.loads(raw)["error"]["code"] == "server_shutting_down" and int(headers["retry-after"]) >= 1
        assert at - t0 < 2.5, at - t0  # promptly (before: ~7 s, then a bare 500)
    status, ctype, raw, headers, at = results[0]
    assert ctype.startswith("application/json"), (status, raw[:300])
    body = json.loads(raw)
    if status == 200:  # it finished within the grace period
        assert body["choices"][0]["finish_reason"] == "length"
    else:
        assert status == 503 and body["error"]["code"] == "server_shutting_down", (status, body)
        assert at - t0 < 1 + 3  # the grace period, then one step
    for bad in ("Traceback", "Exception in ASGI", "CancelledError", "went away", "timeout graceful shutdown exceeded"):
        assert bad not in err, err[-3000:]
    assert "shutting down" in err and "Application shutdown complete" in err
    assert MARKER not in out + err and "Number 7" not in out + err  # no prompt text without --log-prompts


# ---------------------------------------------------------------- 7. batch output survives SIGKILL and Ctrl-C


@pytest.mark.model
def test_batch_killed_mid_run_resumes(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = [f"r{i}" for i in range(8)]
    inp.write_text("".join(json.dumps({"id": i, "prompt": f"Count from {n} to {n + 20}.", "max_tokens": 12}) + "\n"
                           for n, i in enumerate(ids)))
    args = CLI + ["generate", "--input", str(inp), "--output", str(out), "--threads", "1", "--ctx", "256",
                  "--temperature", "0", "--parallel", "2"]  # two at a time: records land in four rounds
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 90
    while not (out.exists() and out.read_bytes().count(b"\n") >= 2):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-2000:]
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=10)
    data = out.read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    assert data == complete  # each record is one write: no half line even under SIGKILL
    first = [json.loads(line) for line in complete.splitlines()]
    assert 2 <= len(first) < len(ids) and all("text" in r for r in first)
    done = [r["id"] for r in first]  # each as it finished
    assert len(set(done)) == len(done) and set(done) <= set(ids)

    # Ctrl-C: the records in flight are lost, the rest stays, and the exit status says "interrupted"
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while out.read_bytes().count(b"\n") < len(first) + 1:
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-2000:]
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert "run the same command again to resume" in err and "Traceback" not in err
    assert out.read_bytes().endswith(b"\n")

    p = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == ids  # each id once: the done ones were skipped
    assert records[:len(first)] == first and all(r.get("finish_reason") for r in records)
