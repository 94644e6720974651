"""`localspec serve`: the OpenAI-compatible server, for real: uvicorn on a free 127.0.0.1 port, the
official `openai` client for the happy paths, raw HTTP (httpx) for every error.

One engine and one in-process server for the module (uvicorn in a thread), plus one real
`localspec serve` subprocess (--api-key, --max-queue 0) started at the top so that it loads while
the other tests run. A fake engine covers what real models cannot trigger (server errors)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from localspec.runtime.engine import Engine
from localspec.options import GenerationOptions
from localspec.outputs import Stats
from localspec.server import EngineWorker, create_app
from serving import CLI, ThreadedServer, cli_serve, free_port, paced_engine, raw_http, wait_ready

MODEL = "smollm2"
N_CTX = 1024
MAX_BODY = 64 * 1024
API_KEY = "s3cret-key"
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # greedy SmolLM2 keeps counting: a long generation


def metric(url: str, name: str, **labels) -> float:
    """A sample's value from /metrics (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of a server-sent-event stream (JSON decoded; "[DONE]" as is)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
        else:
            assert line == "", line
    return out


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cli_server(pair_paths, tmp_path_factory):
    """The real command, started early (it loads while other tests run); waited for on first use.
    The key comes from a file (a key on the command line would show in ps)."""
    keyfile = tmp_path_factory.mktemp("key") / "api.key"
    keyfile.write_text(API_KEY + "\n")
    with cli_serve("--api-key-file", str(keyfile), "--parallel", "1", "--max-queue", "0", "--ctx", "512",
                   "--threads", "1") as handle:
        yield handle


@pytest.fixture(scope="module")
def worker(pair_paths, cli_server):
    from localspec.runtime.engine import Engine

    oracle, draft = pair_paths
    with Engine(oracle, draft, n_ctx=N_CTX, n_threads=1, draft_length=4) as engine:
        w = EngineWorker(engine, max_queue=16)
        yield w
        w.close()
        assert not w._thread.is_alive()


@pytest.fixture(scope="module")
def server(worker, registry):
    app = create_app(worker, model_name=MODEL, aliases=[registry.pair(None).oracle], max_body=MAX_BODY)
    s = ThreadedServer(app)
    yield s.url
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


# ---------------------------------------------------------------- the openai client


@pytest.mark.model
def test_models_list_and_retrieve(client, registry):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    assert client.models.retrieve(MODEL).id == MODEL
    assert client.models.retrieve(registry.pair(None).oracle).id == MODEL  # the oracle's registry name too
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


@pytest.mark.model
def test_chat_completion_and_stream_agree(client):
    kw = dict(model=MODEL, messages=chat("What is the capital of France?"), max_tokens=8, temperature=0)
    r = client.chat.completions.create(**kw)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    choice = r.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.drafted > 0 and 0 <= u.accepted <= u.drafted  # the speculative stats inside usage
    assert u.acceptance_rate == pytest.approx(u.accepted / u.drafted, abs=1e-3)
    assert u.regime == "greedy"  # the policy's estimates for greedy requests priced it

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content  # greedy: the stream is the same answer
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt: prefix reuse


@pytest.mark.model
def test_completion_and_stream(client):
    r = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.choices[0].text.startswith(" 11, 12")
    assert r.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked


@pytest.mark.model
def test_stop_strings(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=20, temperature=0, stop=", 8")
    assert r.choices[0].text == " 6, 7" and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=chat("What is the capital of France?"),
                                       max_tokens=20, temperature=0, stop=["Paris", "zzz"])
    assert "Paris" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"


@pytest.mark.model
def test_seed_reproducible(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=chat("Write a word."), max_tokens=5,
                                              temperature=1.0, seed=seed).choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert len({first, sample(8), sample(9)}) > 1  # sampling does vary with the seed


@pytest.mark.model
def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=chat("Say hello."), max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3 and bytes(t.bytes).decode() == t.token
        assert t.top_logprobs[0].token == t.token  # greedy emits the oracle's argmax
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    no = client.chat.completions.create(model=MODEL, messages=chat("Say hello."), max_tokens=6, temperature=0)
    assert no.choices[0].logprobs is None

    c = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == 5
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == len(COUNTING)

    chunks = list(client.chat.completions.create(model=MODEL, messages=chat("Say hello."), max_tokens=6,
                                                 temperature=0, logprobs=True, stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


@pytest.mark.model
def test_speculative_extension(client):
    kw = dict(model=MODEL, messages=chat("Name a fruit."), max_tokens=8, temperature=0)
    spec = client.chat.completions.create(**kw)
    plain = client.chat.completions.create(**kw, extra_body={"speculative": {"enabled": False}})
    undrafted = client.chat.completions.create(**kw, extra_body={"speculative": {"draft_max": 0}})
    assert spec.usage.drafted > 0
    assert plain.usage.drafted == plain.usage.accepted == undrafted.usage.drafted == 0
    assert plain.choices[0].message.content == spec.choices[0].message.content  # the oracle's greedy answer


@pytest.mark.model
def test_eight_simultaneous_streams(client, server):
    prompts = ["Hi", "What is 2+2?", "Name a color.", "Tell me a joke.", "What is the capital of France?",
               "Say yes.", "Count to three.", "Name a fruit."]
    alone = {p: client.chat.completions.create(model=MODEL, messages=chat(p), max_tokens=4,
                                               temperature=0).choices[0].message.content for p in prompts[:2]}
    results: dict[str, list] = {}
    errors: list[BaseException] = []

    def run(p):
        try:
            results[p] = list(client.chat.completions.create(model=MODEL, messages=chat(p), max_tokens=4,
                                                             temperature=0, stream=True))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 8
    assert len({chunks[0].id for chunks in results.values()}) == 8
    for p, chunks in results.items():
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text.strip()
        if p in alone:
            assert text == alone[p]  # queued behind others, the same answer: no cross-talk
    assert metric(server, "localspec_queue_depth") == 0


@pytest.mark.model
def test_disconnect_mid_stream_frees_the_engine(server, http, worker):
    cancelled = worker.cancelled
    generated = metric(server, "localspec_tokens_generated_total")
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:
                        break  # leave mid-stream: closing the response drops the connection
    deadline = time.monotonic() + 20
    while worker.cancelled == cancelled:
        assert time.monotonic() < deadline, "the disconnected generation was not cancelled"
        time.sleep(0.05)
    wasted = metric(server, "localspec_tokens_generated_total") - generated
    assert wasted < 100, wasted  # stopped within a step or so of the disconnect, not 400 tokens
    assert metric(server, "localspec_generations_total", outcome="cancelled") >= 1

    t0 = time.monotonic()
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "The sea is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert time.monotonic() - t0 < 15  # the engine was free: not behind ~390 more tokens
    deadline = time.monotonic() + 5  # the worker finishes its bookkeeping just after the last chunk
    while worker.busy:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert worker.queue_depth == 0


@pytest.mark.model
def test_metrics(server, http):
    http.post("/v1/chat/completions", json={"messages": chat("Hi"), "max_tokens": 4, "temperature": 0})
    text = http.get("/metrics").text
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")
    assert metric(server, "localspec_requests_total", endpoint="/v1/chat/completions", status="200") >= 1
    assert metric(server, "localspec_tokens_generated_total") >= 4
    drafted = metric(server, "localspec_tokens_drafted_total")
    accepted = metric(server, "localspec_tokens_accepted_total")
    assert drafted > 0 and 0 <= accepted <= drafted
    assert metric(server, "localspec_acceptance_rate") == pytest.approx(accepted / drafted)
    assert metric(server, "localspec_time_to_first_token_seconds_count") >= 1
    assert metric(server, "localspec_request_latency_seconds_count", endpoint="/v1/chat/completions") >= 1
    assert "localspec_queue_depth" in text
    assert metric(server, "localspec_host_seconds_total", phase="verify") > 0  # wall time outside llama.cpp


def test_metrics_count_draft_tokens_by_source():
    """Each step's draft tokens and accepted ones also count under where the draft came from."""
    from localspec.outputs import DraftSource, StepRecord
    from localspec.server.metrics import Metrics

    m = Metrics()
    for source, drafted, accepted in ((DraftSource.SUFFIX, 8, 6), (DraftSource.MODEL, 4, 1), (DraftSource.SUFFIX, 5, 0),
                                      (DraftSource.NONE, 0, 0)):
        m.record_step(StepRecord(k=drafted, drafted=drafted, accepted=accepted, draft_time=0.0, verify_time=0.0,
                                 context=10, source=source))
    value = lambda name, source: m.registry.get_sample_value(name + "_total", {"source": source})  # noqa: E731
    assert value("localspec_spec_decode_num_draft_tokens_by_source", "suffix") == 13
    assert value("localspec_spec_decode_num_accepted_tokens_by_source", "suffix") == 6
    assert value("localspec_spec_decode_num_accepted_tokens_by_source", "model") == 1
    assert value("localspec_spec_decode_num_draft_tokens_by_source", "") is None  # a step that drafted nothing
    assert m.registry.get_sample_value("localspec_spec_decode_num_draft_tokens_total") == 17


def test_token_sources_include_the_suffix_cache():
    """Every source the engine labels a token with (runtime/apply.py's _DRAFT_SOURCES, and "oracle") is one
    the report's schema takes: a token the suffix cache drafted must not fail the reply."""
    from localspec.runtime.apply import _DRAFT_SOURCES
    from localspec.server import schemas as S

    labels = [*_DRAFT_SOURCES.values(), "oracle"]
    assert "suffix" in labels
    report = S.SpeculationReport(sources=[(f"piece{i}", label) for i, label in enumerate(labels)])
    assert [source for _, source in report.sources] == labels


@pytest.mark.model
def test_health_docs_and_no_prompts_in_logs(server, http, worker, caplog):
    h = http.get("/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL
    assert http.get("/openapi.json").json()["paths"].keys() >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    assert http.get("/docs").status_code == 200
    marker = "zebra-crossing-marker"
    body = {"messages": chat(f"Repeat: {marker}"), "max_tokens": 6, "temperature": 0}
    with caplog.at_level("DEBUG"):
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
    reply = r.json()["choices"][0]["message"]["content"]
    assert "chat:" in caplog.text  # the request was logged...
    assert marker not in caplog.text and reply not in caplog.text  # ...not its text
    caplog.clear()

    from starlette.testclient import TestClient

    with caplog.at_level("INFO"):  # the same worker behind an app with --log-prompts
        r = TestClient(create_app(worker, model_name=MODEL, log_prompts=True), base_url="http://localhost").post("/v1/chat/completions", json=body)
        assert r.status_code == 200
    assert marker in caplog.text and repr(r.json()["choices"][0]["message"]["content"]) in caplog.text


# ---------------------------------------------------------------- errors, raw HTTP


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


BAD_CHAT = [
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"top_logprobs": 2}, None),  # needs logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),  # biases are in [-100, 100]
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                   "function": {"name": "g"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"grammar": "start: foo"}, "grammar"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"speculative": {"draft_max": -1}}, "speculative"),
    ({"frobnicate": True}, "frobnicate"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
]


@pytest.mark.model
@pytest.mark.parametrize("change,param", BAD_CHAT, ids=[json.dumps(c)[:40] for c, _ in BAD_CHAT])
def test_invalid_chat_parameters_are_400(http, change, param):
    body = {"model": MODEL, "messages": chat("Hi"), "max_tokens": 4, **change}
    err = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err


@pytest.mark.model
@pytest.mark.parametrize("change,param", [({"prompt": []}, "prompt"), ({"logprobs": 21}, "logprobs"),
                                          ({"prompt": [[]]}, "prompt"), ({"best_of": 3}, "best_of"),
                                          ({"n": 9, "prompt": ["a", "b"]}, "n"), ({"prompt": None}, "prompt")])
def test_invalid_completion_parameters_are_400(http, change, param):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **change}
    err = error_of(http.post("/v1/completions", json=body), 400)
    assert err["param"].startswith(param)


@pytest.mark.model
def test_missing_and_malformed_bodies_are_400(http):
    err = error_of(http.post("/v1/chat/completions", json={"model": MODEL}), 400)
    assert err["param"] == "messages" and "Missing" in err["message"]
    err = error_of(http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}), 400)
    assert "JSON" in err["message"]
    error_of(http.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    # curl -d sends form-urlencoded: the body is still read as JSON
    r = http.post("/v1/completions", content=json.dumps({"prompt": "Hi", "max_tokens": 2}),
                  headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text


@pytest.mark.model
def test_prompt_longer_than_the_context_is_400(http):
    err = error_of(http.post("/v1/chat/completions", json={"messages": chat("hello " * 1500), "max_tokens": 4}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    err = error_of(http.post("/v1/completions", json={"prompt": "hello " * 1500, "max_tokens": 4}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"


@pytest.mark.model
def test_unknown_model_is_404(http):
    err = error_of(http.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": chat("Hi")}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    error_of(http.post("/v1/completions", json={"model": "gpt-4o", "prompt": "Hi"}), 404)
    error_of(http.get("/v1/models/gpt-4o"), 404)
    error_of(http.get("/v1/nothing-here"), 404)


@pytest.mark.model
def test_oversized_body_is_413(http):
    big = {"model": MODEL, "messages": chat("x" * (MAX_BODY + 10)), "max_tokens": 1}
    err = error_of(http.post("/v1/chat/completions", json=big), 413)
    assert err["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit is enforced while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]

    error_of(http.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"}), 413)


# every Content-Type is read as JSON: one rule (curl -d sends a form type, others text/plain, ...)
CONTENT_TYPES = [None, "application/json", "application/json; charset=utf-8", "text/json", "application/x-ndjson",
                 "application/x-json-stream", "text/plain", "application/x-www-form-urlencoded",
                 "application/octet-stream", "multipart/form-data; boundary=x"]


@pytest.mark.model
@pytest.mark.parametrize("content_type", CONTENT_TYPES, ids=[str(c).split(";")[0] for c in CONTENT_TYPES])
def test_every_content_type_is_read_as_json(http, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}).encode()
    r = http.post("/v1/completions", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1
    err = error_of(http.post("/v1/completions", content=b"prompt=Hi", headers=headers), 400)
    assert err["code"] == "invalid_json"  # and what is not JSON is the same error whatever the type


# the client's own path to the field, never a pydantic location ("speculative.Speculative.draft_max", "stop.str")
PARAM_PATHS = [
    ({"speculative": {"draft_max": -1}}, "speculative.draft_max", "invalid_value"),
    ({"speculative": {"draft_max": 2, "extra": 1}}, "speculative.extra", "unknown_parameter"),
    ({"stop": [1]}, "stop[0]", "invalid_type"),
    ({"stop": 5}, "stop", "invalid_type"),
    ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}, "messages[1].role", "missing_required_parameter"),
    ({"messages": [{"role": "wizard", "content": "a"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [None]}, "messages[0]", "invalid_type"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage", "invalid_type"),
    ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ({"tools": [{"type": "function"}]}, "tools[0]", "invalid_value"),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ({"n": 0}, "n", "invalid_value"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),  # without stream: true
]


@pytest.mark.model
@pytest.mark.parametrize("change,param,code", PARAM_PATHS, ids=[p for _, p, _ in PARAM_PATHS])
def test_error_param_is_the_clients_path_and_code_is_set(http, change, param, code):
    body = {"model": MODEL, "messages": chat("Hi"), "max_tokens": 1, **change}
    err = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert (err["param"], err["code"]) == (param, code), err
    assert param in err["message"]


@pytest.mark.model
def test_body_errors_say_what_is_wrong(http):
    err = error_of(http.post("/v1/chat/completions", content=b"", headers={"content-type": "application/json"}), 400)
    assert err["param"] is None and err["code"] == "invalid_json" and "empty" in err["message"]
    assert "None" not in err["message"]
    err = error_of(http.post("/v1/completions", content=b"[1, 2]"), 400)
    assert err["code"] == "invalid_type" and "JSON object" in err["message"] and "an array" in err["message"]
    err = error_of(http.post("/v1/completions", content=b'{"prompt": "caf\xe9"}'), 400)
    assert err["code"] == "invalid_json" and "UTF-8" in err["message"]
    err = error_of(http.post("/v1/completions", json={"prompt": 42}), 400)
    assert err["param"] == "prompt" and "expected a string or an array, but got an integer" in err["message"]
    err = error_of(http.post("/v1/chat/completions", json={"model": MODEL}), 400)
    assert err["message"] == "Missing required parameter: 'messages'." and err["code"] == "missing_required_parameter"
    err = error_of(http.post("/v1/chat/completions", json={"messages": chat("Hi"), "frobnicate": 1}), 400)
    assert err["param"] == "frobnicate" and err["code"] == "unknown_parameter"


# OpenAI's types are strict: a string is not an integer, a boolean is not a seed
STRICT_TYPES = [
    ("max_tokens", "8"), ("max_tokens", 8.0), ("max_tokens", True), ("seed", True), ("seed", "1"),
    ("temperature", "0.5"), ("temperature", False), ("top_k", "2"), ("stream", "true"), ("stream", 1),
    ("logprobs", 1), ("n", 1.0), ("stop", ["a", 1]), ("max_completion_tokens", "4"),
]


@pytest.mark.model
@pytest.mark.parametrize("name,value", STRICT_TYPES, ids=[f"{n}={json.dumps(v)}" for n, v in STRICT_TYPES])
def test_values_of_the_wrong_json_type_are_400(http, name, value):
    body = {"model": MODEL, "messages": chat("Hi"), "max_tokens": 1, name: value}
    err = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert err["code"] == "invalid_type" and err["param"].startswith(name), err
    assert "Invalid type for" in err["message"]


@pytest.mark.model
def test_values_of_the_right_type_still_work(http):
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 2, "temperature": 0, "top_p": 1, "seed": 3,
            "stream": False, "stop": None, "n": 1, "speculative": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


@pytest.mark.model
def test_the_same_error_has_the_same_code(http):
    big = json.dumps({"model": MODEL, "messages": chat("x" * (MAX_BODY + 10)), "max_tokens": 1}).encode()

    def chunked():
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    declared = error_of(http.post("/v1/chat/completions", content=big), 413)
    streamed = error_of(http.post("/v1/chat/completions", content=chunked()), 413)
    assert declared == streamed and declared["code"] == "request_too_large"
    not_json = error_of(http.post("/v1/completions", content=b"{nope"), 400)
    not_utf8 = error_of(http.post("/v1/completions", content=b"\xff\xfe{}"), 400)
    assert not_json["code"] == not_utf8["code"] == "invalid_json"


@pytest.mark.model
def test_max_tokens_limit_clamps_and_is_the_chat_default(worker):
    """--max-tokens-limit: a larger max_tokens is clamped (finish_reason "length"), as llama.cpp's
    server does, and a chat request without max_tokens gets the limit, not the whole context."""
    from starlette.testclient import TestClient

    with TestClient(create_app(worker, model_name=MODEL, max_tokens_limit=5), base_url="http://localhost") as c:
        for body in ({"prompt": COUNTING, "max_tokens": 10 ** 30}, {"prompt": COUNTING, "max_tokens": 6}):
            r = c.post("/v1/completions", json={**body, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/chat/completions", json={"messages": chat(f"Continue counting: {COUNTING}"), "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 5
        r = c.post("/v1/completions", json={"prompt": COUNTING, "max_tokens": 3, "temperature": 0})
        assert r.json()["usage"]["completion_tokens"] == 3  # under the limit: as asked
    app = create_app(worker, model_name=MODEL)
    assert app.state.max_tokens_limit == N_CTX // 2  # the default: half the context


@pytest.mark.model
def test_time_limit_ends_a_generation_with_length(worker):
    from starlette.testclient import TestClient

    app = create_app(worker, model_name=MODEL, time_limit=0.3, max_tokens_limit=N_CTX)
    with TestClient(app, base_url="http://localhost") as c:
        t0 = time.monotonic()
        r = c.post("/v1/completions", json={"prompt": COUNTING, "max_tokens": 900, "temperature": 0})
        elapsed = time.monotonic() - t0
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert 0 < body["usage"]["completion_tokens"] < 900 and body["choices"][0]["text"].startswith(" 1")
        assert elapsed < 10, elapsed  # 900 tokens would take far longer
        with c.stream("POST", "/v1/completions", json={"prompt": COUNTING, "max_tokens": 900, "temperature": 0,
                                                       "stream": True}) as s:
            events = sse_events(s)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert metric_from(app, "localspec_generations_total", outcome="time_limit") >= 2


def metric_from(app, name: str, **labels) -> float:
    for family in text_string_to_metric_families(app.state.metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_a_stalled_request_body_times_out():
    """Content-Length says 1000, 10 bytes come, then nothing: 408 with an error body, the
    connection closed, and the server still answers. No model needed: the body never arrives."""
    engine = paced_engine()
    s = ThreadedServer(create_app(engine, model_name="paced", body_timeout=0.5))
    try:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n")
        data, elapsed = raw_http(s.port, head + b'{"prompt":')
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        body = json.loads(data.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_timeout"
        assert elapsed < 5, elapsed
        assert not engine.calls
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " 1, 2,"
    finally:
        s.stop()


# ---------------------------------------------------------------- cross-site requests, DNS rebinding, OPTIONS


@pytest.mark.model
def test_a_web_page_cannot_drive_the_server(server, http, worker):
    """A form or fetch() from another site: text/plain needs no CORS preflight, so the browser
    sends it; the server refuses it before any generation (403, an OpenAI error body)."""
    completed = worker.completed
    body = json.dumps({"prompt": "Hi", "max_tokens": 2})
    for origin in ("http://evil.example", "null", "http://127.0.0.1:1", "https://localhost"):
        r = http.post("/v1/completions", content=body, headers={"content-type": "text/plain", "origin": origin})
        assert error_of(r, 403)["code"] == "origin_not_allowed", origin
    r = http.options("/v1/completions", headers={"origin": "http://evil.example",
                                                  "access-control-request-method": "POST"})
    assert error_of(r, 403)["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    assert error_of(http.get("/v1/models", headers={"origin": "http://evil.example"}), 403)
    assert worker.completed == completed  # nothing ran
    # the server's own pages (/docs) may call it: same origin
    r = http.post("/v1/completions", content=body, headers={"origin": server})
    assert r.status_code == 200, r.text


@pytest.mark.model
def test_allowed_origins_get_cors(worker):
    from starlette.testclient import TestClient

    app = create_app(worker, model_name=MODEL, cors_origins=["http://localhost:3000"])
    with TestClient(app, base_url="http://localhost") as c:
        pre = c.options("/v1/chat/completions", headers={
            "origin": "http://localhost:3000", "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type, x-stainless-lang"})
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                   headers={"origin": "http://localhost:3000"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "retry-after" in r.headers["access-control-expose-headers"].lower()
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"origin": "http://localhost:3001"})
        assert error_of(r, 403)["code"] == "origin_not_allowed"
    with TestClient(create_app(worker, model_name=MODEL, cors_origins=["*"]), base_url="http://localhost") as c:
        r = c.get("/v1/models", headers={"origin": "https://anything.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


@pytest.mark.model
def test_options_is_answered(http):
    r = http.options("/v1/chat/completions")
    assert r.status_code == 204 and r.headers["allow"] == "OPTIONS, POST"
    r = http.options("/v1/models")
    assert r.status_code == 204 and set(r.headers["allow"].split(", ")) >= {"GET", "OPTIONS"}
    error_of(http.options("/v1/nothing-here"), 404)


@pytest.mark.model
def test_dns_rebinding_host_names_are_refused(server, http, worker):
    """A page on evil.example whose DNS now points at 127.0.0.1 sends Host: evil.example."""
    port = server.rsplit(":", 1)[1]
    completed = worker.completed
    for host in (f"evil.example:{port}", "evil.example", "localhost.evil.example", "127.0.0.1.nip.io",
                 f"10.0.0.1:{port}", "a@127.0.0.1", ""):
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"host": host})
        assert error_of(r, 403)["code"] == "host_not_allowed", host
    assert worker.completed == completed
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"app.localhost:{port}", "127.0.0.2",
                 f"[::1]:{port}", "LOCALHOST."):
        assert http.get("/v1/models", headers={"host": host}).status_code == 200, host


def test_host_rule():
    from localspec.server.gate import HostRule, OriginRule, split_host

    loop = HostRule("127.0.0.1")
    assert loop.allows("localhost") and loop.allows("127.0.0.1") and loop.allows("::1") and loop.allows("x.localhost")
    assert not loop.allows("10.0.0.5") and not loop.allows("evil.example") and not loop.allows("localhost.evil")
    every = HostRule("0.0.0.0")
    assert every.allows("192.168.1.20") and every.allows("::1") and not every.allows("evil.example")
    import socket

    assert every.allows(socket.gethostname().lower())  # this machine's name, when on every interface
    assert not loop.allows(socket.gethostname().lower()) or socket.gethostname().lower().endswith(".localhost")
    one = HostRule("192.168.1.20", ["api.example.com", "*.lan"])
    assert one.allows("192.168.1.20") and not one.allows("192.168.1.21")
    assert one.allows("api.example.com") and one.allows("box.lan") and one.allows("lan") and not one.allows("evil.com")
    named = HostRule("myhost.lan")
    assert named.allows("myhost.lan") and not named.allows("other.lan")
    assert HostRule("127.0.0.1", ["*"]).allows("anything.example")
    assert split_host("[::1]:8080") == ("::1", 8080) and split_host("Example.COM.") == ("example.com", None)
    assert split_host("a:b") is None and split_host("[::1") is None and split_host("x/y") is None

    rule = OriginRule(["http://localhost:3000", "HTTPS://App.Example:443/"])
    assert rule.allows("http://localhost:3000", None) and rule.allows("https://app.example", None)
    assert not rule.allows("http://localhost:3001", None) and not rule.allows("null", ("localhost", 8080))
    assert rule.allows("http://127.0.0.1:8080", ("127.0.0.1", 8080))  # same origin
    assert rule.allows("https://api.example", ("api.example", None))  # behind a TLS proxy
    assert not rule.allows("http://127.0.0.1:8081", ("127.0.0.1", 8080))


# ---------------------------------------------------------------- the API key


@pytest.mark.model
def test_api_key_scheme_is_case_insensitive_and_metrics_need_the_key(worker):
    from starlette.testclient import TestClient

    key = "k-" + "z" * 30
    with TestClient(create_app(worker, model_name=MODEL, api_key=key), base_url="http://localhost") as c:
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
            assert c.get("/v1/models", headers={"Authorization": f"{scheme} {key}"}).status_code == 200, scheme
        for value in (f"Basic {key}", f"Bearer{key}", f"Bearer {key}x", key, f"Token {key}"):
            assert c.get("/v1/models", headers={"Authorization": value}).status_code == 401, value
        err = error_of(c.get("/metrics"), 401)
        assert err["code"] == "invalid_api_key"
        r = c.get("/metrics", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and "localspec_requests_total" in r.text
        assert c.get("/health").status_code == 200  # liveness probes need no key


def test_serve_refuses_an_empty_or_unusable_api_key(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k != "LOCALSPEC_API_KEY"}
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    spaced = tmp_path / "spaced.key"
    spaced.write_text("two words\n")
    cases = [
        (["--api-key", ""], {}, "--api-key is empty"),
        ([], {"LOCALSPEC_API_KEY": ""}, "$LOCALSPEC_API_KEY is empty"),
        (["--api-key-file", str(empty)], {}, "is empty"),
        (["--api-key-file", str(spaced)], {}, "printable ASCII without spaces"),
        (["--api-key-file", str(tmp_path / "missing.key")], {}, "No such file"),
        (["--api-key", "a", "--api-key-file", str(spaced)], {}, "not both"),
        (["--cors-origin", "localhost:3000"], {}, "--cors-origin"),
        (["--allowed-host", "http://example.com/"], {}, "--allowed-host"),
    ]
    procs = [(subprocess.Popen(CLI + ["serve", "--port", str(free_port()), "--oracle", "/nonexistent/model.gguf",
                                      "--no-draft", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**env, **extra}, stdin=subprocess.DEVNULL), message)
             for args, extra, message in cases]
    for p, message in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2, err
        assert message in err and "not found" not in err, err  # refused before the model is even looked for


def test_serve_warns_about_keys_in_ps_and_open_interfaces(tmp_path):
    """The warnings come before the model loads (a missing GGUF then stops each run; all in parallel)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "LOCALSPEC_API_KEY"}
    keyfile = tmp_path / "k"
    keyfile.write_text("abc\n")
    cases = [
        (["--api-key", "abc"], {}, ["visible to every user", "LOCALSPEC_API_KEY"]),
        (["--host", "0.0.0.0"], {}, ["without an API key"]),
        (["--host", "0.0.0.0", "--api-key-file", str(keyfile)], {}, []),
        (["--host", "0.0.0.0"], {"LOCALSPEC_API_KEY": "abc"}, []),
        (["--host", "localhost"], {}, []),
    ]
    procs = [(subprocess.Popen(CLI + ["serve", *args, "--oracle", "/nonexistent/model.gguf", "--no-draft"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, **extra},
                               stdin=subprocess.DEVNULL), needles) for args, extra, needles in cases]
    for p, needles in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2 and "not found" in err, err  # then the missing model stops it
        if needles:
            assert all(n in err for n in needles), err
        else:
            assert "warning" not in err, err


# ---------------------------------------------------------------- shutdown with work in flight (no model: timing)


def _post_in_thread(url: str, body: dict, results: list, index: int, stream: bool = False):
    def run():
        t0 = time.monotonic()
        try:
            if stream:
                with httpx.stream("POST", url, json=body, timeout=30) as r:
                    payload = sse_events(r) if r.status_code == 200 else json.loads(r.read())
                    results[index] = (r.status_code, payload, dict(r.headers), time.monotonic() - t0)
            else:
                r = httpx.post(url, json=body, timeout=30)
                results[index] = (r.status_code, r.json(), dict(r.headers), time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - reported by the test
            results[index] = (None, repr(e), {}, time.monotonic() - t0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@contextmanager
def _paced_server(*, grace: float) -> Iterator[tuple[ThreadedServer, EngineWorker, Engine]]:
    """A server over the paced counting engine (a pass every 20 ms, one slot) with this shutdown
    grace period."""
    engine = paced_engine(step=0.02)
    worker = EngineWorker(engine, max_queue=8)
    try:
        yield ThreadedServer(create_app(worker, model_name="paced"), grace=grace), worker, engine
    finally:
        worker.close()


def test_shutdown_refuses_the_queue_at_once_and_cuts_the_running_one_at_the_grace_period():
    """SIGTERM with one long non-streamed generation running and four queued: the four get 503
    with Retry-After and an error body right away; the running one ends with a 503 error body when
    the grace period is over (not uvicorn's bare 500 when it cancels tasks)."""
    with _paced_server(grace=2.0) as (s, worker, engine):
        url = s.url + "/v1/completions"
        results: list = [None] * 5
        threads = [_post_in_thread(url, {"prompt": "long", "max_tokens": 2000}, results, 0)]
        _wait(lambda: worker.busy)
        threads += [_post_in_thread(url, {"prompt": f"q{i}", "max_tokens": 2}, results, i) for i in range(1, 5)]
        _wait(lambda: worker.queue_depth == 4)
        t0 = time.monotonic()
        stopper = threading.Thread(target=s.stop, daemon=True)
        stopper.start()
        for t in threads[1:]:
            t.join(5)
        queued_done = time.monotonic() - t0
        for status, body, headers, _ in results[1:]:
            assert status == 503, body
            assert body["error"]["code"] == "server_shutting_down" and int(headers["retry-after"]) >= 1
        assert queued_done < 1.5, queued_done  # at once, not after the running one (cut at 2 s)
        threads[0].join(10)
        status, body, headers, _ = results[0]
        assert status == 503 and body["error"]["code"] == "server_shutting_down", body
        assert 1.8 < time.monotonic() - t0 < 6  # at the end of the grace period
        stopper.join(15)
        assert len(engine.calls) == 1  # the queued ones never ran


def test_shutdown_with_eight_slots_running_and_a_queue():
    """SIGTERM with eight streams running and four queued: the queued get 503 at once; the running
    ones end with an error event and [DONE] at the end of the grace period, each having streamed."""
    engine = paced_engine(step=0.02, parallel=8)
    worker = EngineWorker(engine, max_queue=8)
    s = ThreadedServer(create_app(worker, model_name="paced"), grace=1.0)
    try:
        url = s.url + "/v1/completions"
        results: list = [None] * 12
        threads = [_post_in_thread(url, {"prompt": f"r{i}", "max_tokens": 3000, "stream": True}, results, i, stream=True)
                   for i in range(8)]
        _wait(lambda: worker.running == 8)
        threads += [_post_in_thread(url, {"prompt": f"q{i}", "max_tokens": 2}, results, i) for i in range(8, 12)]
        _wait(lambda: worker.queue_depth == 4)
        t0 = time.monotonic()
        s.stop()
        for t in threads:
            t.join(10)
        for status, body, headers, _ in results[8:]:
            assert status == 503 and body["error"]["code"] == "server_shutting_down", body
        for status, events, _, _ in results[:8]:
            assert status == 200 and events[-1] == "[DONE]", events[-3:]
            assert events[0]["choices"][0]["text"].startswith(" 1,")
            assert events[-2]["error"]["code"] == "server_shutting_down"
        assert time.monotonic() - t0 < 8
        assert len(engine.calls) == 8  # the queued ones never ran
    finally:
        worker.close()


def test_shutdown_lets_the_running_generation_finish_within_the_grace_period():
    with _paced_server(grace=5.0) as (s, worker, engine):
        url = s.url + "/v1/completions"
        results: list = [None] * 2
        threads = [_post_in_thread(url, {"prompt": "a", "max_tokens": 40}, results, 0),
                   _post_in_thread(url, {"prompt": "b", "max_tokens": 40, "stream": True}, results, 1, stream=True)]
        service = s.server.config.app.state.service
        # NOTE: the app's side too: the worker takes a job into a slot before the app's event loop
        # hears that it started, and a shutdown in between refused both (a flake under load)
        _wait(lambda: worker.busy and worker.queue_depth == 1 and len(service.running) == 1)
        s.stop()
        for t in threads:
            t.join(10)
        # whichever started first finished (40 steps, ~0.8 s, within the 5 s grace); the other was queued: 503
        assert sorted(str(r[0]) for r in results) == ["200", "503"], results
        ran = next(r for r in results if r[0] == 200)
        if isinstance(ran[1], dict):
            text = ran[1]["choices"][0]["text"]
        else:
            assert ran[1][-1] == "[DONE]"
            text = "".join(e["choices"][0]["text"] for e in ran[1][:-1])
        assert text.endswith(" 39, 40,"), text
        other = next(r for r in results if r is not ran)
        assert other[1]["error"]["code"] == "server_shutting_down"


def test_shutdown_ends_a_running_stream_with_an_error_event_and_done():
    with _paced_server(grace=0.5) as (s, worker, engine):
        results: list = [None]
        t = _post_in_thread(s.url + "/v1/completions", {"prompt": "a", "max_tokens": 2000, "stream": True}, results, 0,
                            stream=True)
        _wait(lambda: worker.busy)
        time.sleep(0.1)
        s.stop()
        t.join(10)
        status, events, _, elapsed = results[0]
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        assert events[-2]["error"]["code"] == "server_shutting_down"
        assert events[0]["choices"][0]["text"] == " 1,"


# ---------------------------------------------------------------- the real command


@pytest.mark.model
def test_cli_serve_api_key_queue_full_and_sigterm(cli_server):
    url = wait_ready(cli_server)
    assert httpx.get(url + "/health").status_code == 200  # /health needs no key, /metrics does
    assert error_of(httpx.get(url + "/metrics"), 401)["code"] == "invalid_api_key"
    assert httpx.get(url + "/metrics", headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        err = error_of(httpx.get(url + "/v1/models", headers=headers), 401)
        assert err["code"] == "invalid_api_key"
    error_of(httpx.post(url + "/v1/chat/completions", content=b"{not json"), 401)  # auth comes first
    with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()

    auth = {"Authorization": f"Bearer {API_KEY}"}
    with openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as good:
        assert [m.id for m in good.models.list().data] == [MODEL]
        r = good.chat.completions.create(model=MODEL, messages=chat("Say hi"), max_tokens=4, temperature=0)
        assert r.choices[0].message.content and r.usage.completion_tokens <= 4

    # --parallel 1 --max-queue 0: while one generation runs, the next request gets 429 with Retry-After
    with httpx.Client(base_url=url, headers=auth, timeout=60) as c:
        body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 300, "temperature": 0, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as slow:
            assert slow.status_code == 200
            lines = slow.iter_lines()  # keep it referenced: a dropped iterator closes the connection
            assert next(lines).startswith("data: ")  # it is running
            busy = httpx.post(url + "/v1/completions", headers=auth, json={"prompt": "Hi", "max_tokens": 2})
            err = error_of(busy, 429)
            assert int(busy.headers["Retry-After"]) >= 1 and err["type"] == "rate_limit_error"
    deadline = time.monotonic() + 20  # the disconnect frees the engine
    while httpx.get(url + "/health").json()["busy"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert httpx.post(url + "/v1/completions", headers=auth, json={"prompt": "Hi", "max_tokens": 2},
                      timeout=60).status_code == 200

    proc = cli_server["proc"]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err and "Application shutdown complete" in err
    assert "Say hi" not in err + out and COUNTING not in err + out  # no prompt text without --log-prompts
    assert re.search(r"1 slot \(requests generated at once\), 512 tokens of context each; KV cache \d+ MiB "
                     r"\(\d+ \+ \d+ MiB: the oracle's, the draft's\)", err), err[-2000:]


# ---------------------------------------------------------------- server errors (a fake engine)


@pytest.mark.parametrize("stream", [False, True])
def test_server_errors_never_leak(stream):
    s = ThreadedServer(create_app(paced_engine(fail="start"), model_name="fake"))
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": chat("Hi"), "stream": stream}, timeout=10)
        err = error_of(r, 500)
        assert err["type"] == "server_error" and "secret" not in r.text and "Traceback" not in r.text
    finally:
        s.stop()


def test_error_mid_stream_is_an_error_event():
    s = ThreadedServer(create_app(paced_engine(fail="mid"), model_name="fake"))
    try:
        with httpx.stream("POST", s.url + "/v1/completions", json={"prompt": "Hi", "stream": True}, timeout=10) as r:
            assert r.status_code == 200
            events = sse_events(r)
        assert events[0]["choices"][0]["text"] == " 1,"
        assert events[1]["error"]["type"] == "server_error" and events[-1] == "[DONE]"
        assert "secret" not in json.dumps(events)
        with openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0) as c:
            with pytest.raises(openai.APIError):
                list(c.completions.create(model="fake", prompt="Hi", stream=True))
    finally:
        s.stop()


def test_worker_queue_limit_and_shutdown():
    """Without models: a job runs in the one slot, max_queue=1 lets one more wait, the third is
    refused; close() cancels the running job within a step and fails the waiting one."""
    from localspec.server.worker import CANCELLED, Failed, Outcome, QueueFull, WorkerClosed

    w = EngineWorker(paced_engine(step=0.01), max_queue=1)
    events: list = []
    first = w.submit("a", GenerationOptions(max_tokens=4000), events.append)
    w.submit("b", GenerationOptions(), events.append)
    with pytest.raises(QueueFull) as e:
        w.submit("c", GenerationOptions(), events.append)
    assert e.value.retry_after >= 1
    deadline = time.monotonic() + 5
    while first.tokens < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    w.close(timeout=5)
    assert not w._thread.is_alive() and first.outcome is Outcome.CANCELLED
    assert first.cancel_reason == "the server is shutting down"  # not "the client went away"
    assert CANCELLED in events and any(isinstance(ev, Failed) and isinstance(ev.error, WorkerClosed) for ev in events)
    with pytest.raises(WorkerClosed):
        w.submit("d", GenerationOptions(), events.append)


def test_worker_time_limit_ends_a_job_with_length():
    """A job past its time limit stops after the step in progress, and its last chunk is an empty
    one with finish_reason "length" and the counters so far, as when max_tokens is reached."""
    w = EngineWorker(paced_engine(step=0.02), max_queue=1)
    try:
        events: list = []
        t0 = time.monotonic()
        job = w.submit("a", GenerationOptions(max_tokens=10_000), events.append, time_limit=0.3)
        assert job.done.wait(10)
        assert time.monotonic() - t0 < 3
        from localspec.server.worker import STARTED, Outcome

        final = events[-1]
        assert events[0] is STARTED and final.finish_reason == "length" and final.text == ""
        tokens = sum(len(e.tokens) for e in events[1:])
        assert 3 <= tokens < 1000 and final.stats.completion_tokens == tokens == job.tokens
        assert job.outcome is Outcome.TIME_LIMIT and w.completed == 1
        assert w.metrics.generations.labels("time_limit")._value.get() == 1
        quick: list = []
        job = w.submit("b", GenerationOptions(max_tokens=3), quick.append, time_limit=30)  # under its limit: as asked
        assert job.done.wait(10) and quick[-1].finish_reason == "length" and job.outcome is Outcome.COMPLETED
        assert [c.text for c in quick[1:]] == [" 1,", " 2,", " 3,"]
    finally:
        w.close()


def test_the_server_modules_import_downward_only():
    """server/__init__.py lists the modules top down; each imports only modules below it (no circle)."""
    import ast
    import re
    from pathlib import Path

    import localspec.server as server

    order = re.findall(r"^    (\w+)\.py ", server.__doc__, re.M)
    folder = Path(server.__file__).parent
    assert sorted(order) == sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    for i, name in enumerate(order):
        imported = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "localspec.server":
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("localspec.server."):
                imported.add(node.module.rsplit(".", 1)[1])
        assert imported <= set(order[i + 1:]), (name, imported - set(order[i + 1:]))


def test_stats_usage_shape():
    from localspec.server.render import usage_of

    u = usage_of(Stats(prompt_tokens=10, prompt_tokens_evaluated=4, completion_tokens=5, steps=3, drafted=8, accepted=6,
                     lookup_drafted=3, lookup_accepted=2, suffix_drafted=1, suffix_accepted=1,
                     regime="temperature 0.85-1.15", idle_steps=2, idle_reason="because"))
    assert u.model_dump() == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                              "prompt_tokens_details": {"cached_tokens": 6}, "steps": 3, "drafted": 8, "accepted": 6,
                              "acceptance_rate": 0.75, "regime": "temperature 0.85-1.15", "idle_steps": 2,
                              "idle_reason": "because",
                              "sources": {"model": {"drafted": 4, "accepted": 3}, "lookup": {"drafted": 3, "accepted": 2},
                                          "suffix": {"drafted": 1, "accepted": 1}}}


# ---------------------------------------------------------------- logprobs over a scripted engine


@pytest.fixture(scope="module")
def scripted_server():
    """The server over the real engine on a scripted oracle (tests/scripted.py) whose vocabulary splits
    "\u00e9" and "\u00e8" into byte tokens, and which repeats its prompt; prompt lookup drafts, so one
    step (one streamed chunk) holds several tokens."""
    from localspec.runtime.engine import Engine
    from localspec.speculative.policy import FixedLength
    from localspec.speculative.lookup import PromptLookupProposer
    from scripted import ScriptedContext, ScriptedModel, copying, hashed_logits

    model = ScriptedModel.sized(40)
    oracle = ScriptedContext(model, copying(hashed_logits(1, 40), bonus=8.0))
    engine = Engine.from_parts(oracle=oracle, proposer=PromptLookupProposer(), policy=FixedLength(3))
    s = ThreadedServer(create_app(engine, model_name="scripted"))
    yield s.url, model
    s.stop()


SPLIT = "caf\u00e9 \u00e8. caf\u00e9 \u00e8. "  # "\u00e9" is two tokens, b"\xc3" b"\xa9"


def test_logprob_bytes_are_each_tokens_own(scripted_server):
    url, model = scripted_server
    r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "messages": chat(SPLIT), "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 5})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert bytes(b for t in content for b in t["bytes"]).decode(errors="replace") == choice["message"]["content"]
    pieces = {model.token_piece(t) for t in range(model.n_vocab)}  # control tokens render empty
    entries = content + [top for t in content for top in t["top_logprobs"]]
    assert all(bytes(e["bytes"]) in pieces and bytes(e["bytes"]).decode(errors="replace") == e["token"]
               for e in entries)
    assert any(bytes(e["bytes"]) in (b"\xc3", b"\xa9", b"\xa8") for e in entries)  # never EF BF BD


@pytest.mark.parametrize("stream", [False, True])
def test_text_offsets_count_characters_of_the_returned_text(scripted_server, stream):
    url, _ = scripted_server
    body = {"prompt": SPLIT, "max_tokens": 20, "temperature": 0, "logprobs": 2, "stream": stream}
    if stream:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            events = [e for e in sse_events(r) if e != "[DONE]"]
        text = "".join(e["choices"][0]["text"] for e in events)
        lps = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
        offsets = [o for lp in lps for o in lp["text_offset"]]
        tokens = [t for lp in lps for t in lp["tokens"]]
    else:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        choice = r.json()["choices"][0]
        text, offsets, tokens = choice["text"], choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
    full = SPLIT + text
    assert "\u00e8" in text and "\ufffd" in tokens  # tokens holding part of a character were emitted
    assert offsets[0] == len(SPLIT) and offsets == sorted(offsets)
    for offset, token in zip(offsets, tokens):
        if token == "\ufffd":  # part of a character: it starts where that character does
            assert full[offset] in "\u00e9\u00e8"
        else:
            assert full[offset:offset + len(token)] == token


# ---------------------------------------------------------------- several choices and prompts in one request


@pytest.mark.model
def test_n_choices_are_generated_together_and_each_reproducible_with_a_seed(client):
    r = client.chat.completions.create(model=MODEL, messages=chat("Name a fruit."), max_tokens=8, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 1  # greedy: the same answer three times
    one = client.chat.completions.create(model=MODEL, messages=chat("Name a fruit."), max_tokens=8, temperature=0)
    assert r.choices[0].message.content == one.choices[0].message.content
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    kw = dict(model=MODEL, messages=chat("Tell me a color."), max_tokens=10, temperature=1.0)
    seeded = client.chat.completions.create(**kw, n=2, seed=40)
    alone = [client.chat.completions.create(**kw, seed=s).choices[0].message.content for s in (40, 41)]
    assert [c.message.content for c in seeded.choices] == alone  # choice i: seed + i


@pytest.mark.model
def test_n_choices_stream_interleaved_each_to_its_end(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=chat("Count to five."), max_tokens=12,
                                                 temperature=0, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    by_index: dict[int, list] = {0: [], 1: []}
    finishes = {}
    for c in chunks[:-1]:
        for choice in c.choices:
            by_index[choice.index].append(choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert set(finishes) == {0, 1} and "".join(by_index[0]) == "".join(by_index[1]) != ""
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert len({c.id for c in chunks}) == 1


@pytest.mark.model
def test_a_list_of_prompts_is_one_choice_each_in_prompt_order(http):
    body = {"model": MODEL, "prompt": ["The sky is", "Water is"], "max_tokens": 5, "temperature": 0, "n": 2}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    singles = [http.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 5,
                                                   "temperature": 0}).json() for p in body["prompt"]]
    assert [c["text"] for c in choices] == [singles[0]["choices"][0]["text"]] * 2 + [singles[1]["choices"][0]["text"]] * 2
    assert r.json()["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)


def test_text_keys_of_logit_bias_bias_every_token_of_the_text(scripted_server):
    """llama-server's string-keyed logit_bias: a key that is not a token id is text, and each of its
    tokens gets the bias. The scripted oracle repeats its prompt; banning " b" (two tokens: " ",
    "b") and "c" leaves neither in the reply, where without the bias the reply repeats them."""
    url, model = scripted_server
    body = {"prompt": "abc abc abc ", "max_tokens": 12, "temperature": 0}
    plain = httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
    assert "b" in plain and "c" in plain
    for bias in ({" b": -100, "c": -100}, {" b": -100, str(model.tokenize("c", add_special=False)[0]): -100}):
        r = httpx.post(url + "/v1/completions", json={**body, "logit_bias": bias}, timeout=30)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert text and not set(text) & {" ", "b", "c"}
    r = httpx.post(url + "/v1/chat/completions", json={"messages": chat("abc abc"), "max_tokens": 8,
                                                        "temperature": 0, "logit_bias": {"": -1}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


@pytest.mark.parametrize("echo", [False, True])
def test_logprobs_zero_gives_the_chosen_tokens_logprobs_and_no_alternatives(scripted_server, echo):
    """/v1/completions' legacy `logprobs: 0`: each chosen token's logprob and text offset, and as
    `top_logprobs` the chosen token alone (OpenAI's reference: the sampled token's logprob is always
    returned, up to logprobs + 1 of them; vLLM does so too); with echo, the prompt's tokens in front
    (the first with a null logprob)."""
    url, _ = scripted_server
    body = {"prompt": "abc abc ", "max_tokens": 6, "temperature": 0, "logprobs": 0, "echo": echo}
    choice = httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(lp["tokens"])
    assert lp["top_logprobs"] == [None if v is None else {t: v}  # no alternatives asked: the chosen one
                                  for t, v in zip(lp["tokens"], lp["token_logprobs"])]
    assert lp["text_offset"][0] == (0 if echo else len(body["prompt"])) and lp["text_offset"] == sorted(lp["text_offset"])
    assert (lp["token_logprobs"][0] is None) == echo and all(v <= 0 for v in lp["token_logprobs"][1:])


def test_a_lone_surrogate_is_refused_in_the_requests_own_terms(scripted_server):
    """JSON lets a string hold half a UTF-16 surrogate pair ("\\ud800"): no Unicode character, which
    no tokenizer takes. The 400 names the field and says so (it was Python's codec error)."""
    url, _ = scripted_server
    r = httpx.post(url + "/v1/chat/completions", timeout=30, content=b'{"messages": [{"role": "user", '
                   b'"content": "caf\\u00e9 \\ud800 ok"}], "max_tokens": 4}', headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages[0].content" and error["code"] == "invalid_value"
    assert "lone UTF-16 surrogate (U+D800) at character 5" in error["message"] and "codec" not in error["message"]
    r = httpx.post(url + "/v1/completions", timeout=30, content=b'{"prompt": "ab", "stop": ["x", "\\udc00"], '
                   b'"max_tokens": 4}', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop[1]"
    r = httpx.post(url + "/v1/completions", timeout=30, content=b'{"prompt": "ab \\ud83d\\ude00", "max_tokens": 4}',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text  # a whole pair is a character (here an emoji)


@pytest.mark.parametrize("seed, ok", [((1 << 64) - 1, True), (-(1 << 63), True), (1 << 64, False),
                                      (-(1 << 63) - 1, False)])
def test_a_seed_is_a_64_bit_integer(scripted_server, seed, ok):
    """Seeds of -2^63 to 2^64 - 1 (signed or unsigned 64-bit) are taken; others are refused rather
    than reduced without a word (2^64 had silently been the seed 0)."""
    url, _ = scripted_server
    r = httpx.post(url + "/v1/completions", timeout=30,
                   json={"prompt": "ab", "max_tokens": 4, "temperature": 1.0, "seed": seed})
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_logit_bias_takes_at_most_1024_entries(scripted_server):
    """A text key is tokenized before the request is queued: their number is bounded (300,000 of
    them, a 4 MB body, took 8.7 s of the server's event loop), and that work runs off the loop."""
    url, _ = scripted_server
    body = {"prompt": "ab", "max_tokens": 2, "temperature": 0}
    r = httpx.post(url + "/v1/completions", timeout=30, json={**body, "logit_bias": {f"w{i}": 1 for i in range(1025)}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert "at most 1024 entries" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", timeout=30, json={**body, "logit_bias": {f"w{i}": 1 for i in range(1024)}})
    assert r.status_code == 200, r.text


def test_a_steps_events_for_every_client_of_one_loop_wake_it_once():
    """Four streams of one event loop running together: each step's chunks for all of them are
    handed over in one wake-up of the loop (made by the worker's hand-over thread), each stream's
    events in order and whole."""
    import asyncio

    from localspec.server.worker import STARTED

    engine = paced_engine(step=0.005, parallel=4)
    worker = EngineWorker(engine, max_queue=8)
    try:
        async def main():
            loop = asyncio.get_running_loop()
            wakeups = []
            real = loop.call_soon_threadsafe

            def counted(callback, *args, **kw):
                wakeups.append(callback)
                return real(callback, *args, **kw)

            loop.call_soon_threadsafe = counted
            jobs = [worker.submit_async("Count:", GenerationOptions(max_tokens=12, temperature=0)) for _ in range(4)]

            async def read(events):
                seen = []
                while True:
                    event = await events.get()
                    seen.append(event)
                    if getattr(event, "finish_reason", None) is not None:
                        return seen

            streams = await asyncio.gather(*(read(events) for _, events in jobs))
            return streams, wakeups

        streams, wakeups = asyncio.run(main())
    finally:
        worker.close()
    for seen in streams:
        assert seen[0] is STARTED and seen[-1].finish_reason == "length"
        assert sum(len(e.tokens) for e in seen[1:]) == 12 and "".join(e.text for e in seen[1:]).startswith(" 1, 2, 3,")
    events = sum(len(seen) for seen in streams)  # 4 x (STARTED + 12 chunks), the last one finishing
    assert len(wakeups) <= events / 3, (len(wakeups), events)
