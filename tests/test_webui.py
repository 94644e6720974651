"""The extension the chat page reads (`"speculative": {"sources": true}`), for real: one `localspec
serve` of the default pair with an API key (started first, loading while the rest runs)."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import cli_serve, wait_ready

API_KEY = "webui-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PARALLEL = 2
SOURCES = {"draft", "lookup", "oracle"}
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # greedy SmolLM2 keeps counting


@pytest.fixture(scope="module")
def served(pair_paths, tmp_path_factory):
    """The real command with an API key and a fixed draft length (so that replies draft whatever
    this machine's timings would make the adaptive policy choose); waited for on first use."""
    keyfile = tmp_path_factory.mktemp("key") / "api.key"
    keyfile.write_text(API_KEY + "\n")
    with cli_serve("--api-key-file", str(keyfile), "--parallel", str(PARALLEL), "--ctx", "1024",
                   "--threads", "1", "--draft-length", "4") as handle:
        yield {"page": handle}


@pytest.fixture(scope="module")
def url(served) -> str:
    return wait_ready(served["page"])


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed request ([DONE] checked and left out)."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def pieces_of(choice: dict) -> list[tuple[str, str]]:
    return [tuple(p) for p in choice["speculative"]["sources"]]


# ---------------------------------------------------------------- the extension, over HTTP


@pytest.mark.model
def test_each_chunk_says_where_its_text_came_from_and_the_last_one_gives_the_figures(url):
    body = {"messages": [{"role": "user", "content": "List the numbers from 1 to 30, separated by commas."}],
            "max_tokens": 48, "temperature": 0, "stream_options": {"include_usage": True}}
    chunks = stream(url, "/v1/chat/completions", {**body, "speculative": {"sources": True}})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    pieces, figures = [], None
    for choice in choices[1:]:  # after the role's chunk
        spans = pieces_of(choice)  # every chunk of the reply carries its report
        assert "".join(p for p, _ in spans) == choice["delta"].get("content", "")
        assert all(p and source in SOURCES for p, source in spans)
        pieces += spans
        if choice["finish_reason"] is not None:
            figures = choice["speculative"]["figures"]
    usage = chunks[-1]["usage"]
    assert figures is not None and "figures" not in choices[-2]["speculative"]  # the last chunk's only
    for name in ("completion_tokens", "steps", "drafted", "accepted"):
        assert figures[name] == usage[name], name
    assert figures["acceptance_rate"] == usage["acceptance_rate"] > 0
    assert figures["mean_accepted_length"] == pytest.approx(usage["accepted"] / usage["steps"], abs=1e-3)
    assert figures["tokens_per_second"] > 0 and figures["speedup"] > 0
    # ASCII digits and commas: every token has text of its own, so one piece per token
    count = {s: sum(1 for _, source in pieces if source == s) for s in SOURCES}
    assert sum(count.values()) == usage["completion_tokens"]
    assert 0 < count["oracle"] <= usage["steps"]  # one per step, the last step's maybe cut off by max_tokens
    assert 0 < count["draft"] + count["lookup"] <= usage["accepted"]
    assert count["lookup"] <= figures["lookup_accepted"]
    # asking changes nothing but the report
    plain = stream(url, "/v1/chat/completions", body)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in plain if c["choices"]) \
        == "".join(p for p, _ in pieces)


@pytest.mark.model
def test_clients_that_do_not_ask_see_nothing_new(url):
    for extra in ({}, {"speculative": {"enabled": True, "draft_max": 3}}, {"speculative": True}):
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, **extra}
        for chunk in stream(url, "/v1/chat/completions", body):
            for choice in chunk["choices"]:
                assert set(choice) == {"index", "delta", "logprobs", "finish_reason"}, choice
        whole = post(url, "/v1/chat/completions", body)
        assert set(whole["choices"][0]) == {"index", "message", "logprobs", "finish_reason"}
        completion = post(url, "/v1/completions", {"prompt": COUNTING, "max_tokens": 4, **extra})
        assert set(completion["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}


@pytest.mark.model
def test_the_pieces_follow_the_text_through_a_stop_string_whole_replies_and_completions(url):
    """A stop string spanning tokens: the text that could start it is held back, then cut; the
    pieces are held back and cut with it, streamed or whole."""
    body = {"prompt": COUNTING, "max_tokens": 40, "temperature": 0, "stop": ["15, 16"],
            "speculative": {"sources": True}}
    chunks = [c["choices"][0] for c in stream(url, "/v1/completions", body)]
    for choice in chunks:
        assert "".join(p for p, _ in pieces_of(choice)) == choice["text"]
    text = "".join(c["text"] for c in chunks)
    assert text == " 11, 12, 13, 14, " and chunks[-1]["finish_reason"] == "stop"
    assert chunks[-1]["speculative"]["figures"]["completion_tokens"] > len(" 11, 12, 13, 14,".split())
    whole = post(url, "/v1/completions", body)["choices"][0]
    assert whole["text"] == text == "".join(p for p, _ in pieces_of(whole))
    assert whole["speculative"]["figures"]["steps"] > 0
    chat = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to 20: " + COUNTING}],
                                              "max_tokens": 40, "temperature": 0, "stop": ["9"],
                                              "speculative": {"sources": True}})["choices"][0]
    assert chat["message"]["content"] == "".join(p for p, _ in pieces_of(chat)) and "9" not in chat["message"]["content"]
