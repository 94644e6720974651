"""The chat page at / and the extension it reads (`"speculative": {"sources": true}`), for real: one
`localspec serve` of the default pair with an API key (started first, loading while the rest
runs), the extension over raw HTTP, and the page in headless Chromium driven by selenium.

Chromium and its driver are Debian's (`apt-get install chromium chromium-driver`, which .ci/run
does on a fresh machine): without them the browser tests fail, they are never skipped."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import ThreadedServer, cli_serve, free_port, paced_engine, wait_ready

API_KEY = "webui-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PARALLEL = 2
SOURCES = {"draft", "lookup", "suffix", "oracle"}  # suffix: the server's cache of earlier requests (on by default)
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # greedy SmolLM2 keeps counting
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def served(pair_paths, tmp_path_factory):
    """The real command with an API key and a fixed draft length (so that replies draft whatever
    this machine's timings would make the adaptive policy choose), and beside it one with
    --no-webui; both load while other tests run, and are waited for on first use."""
    keyfile = tmp_path_factory.mktemp("key") / "api.key"
    keyfile.write_text(API_KEY + "\n")
    with cli_serve("--api-key-file", str(keyfile), "--parallel", str(PARALLEL), "--ctx", "1024",
                   "--threads", "1", "--draft-length", "4") as handle, \
            cli_serve("--no-webui", "--no-draft", "--parallel", "1", "--ctx", "256", "--threads", "1") as bare:
        yield {"page": handle, "bare": bare}


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
    assert 0 < count["draft"] + count["lookup"] + count["suffix"] <= usage["accepted"]
    assert count["lookup"] <= figures["lookup_accepted"] and count["suffix"] <= figures["suffix_accepted"]
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
    content = chat["message"]["content"]
    assert content == "".join(p for p, _ in pieces_of(chat)) and "9" not in content


@pytest.mark.model
def test_the_page_is_served_from_the_package_and_only_talks_to_this_server(url):
    page = httpx.get(url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "connect-src 'self'" in policy and "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
    for asset in ("/", "/webui/app.js", "/webui/app.css"):  # no address elsewhere: nothing comes from anywhere else
        r = httpx.get(url + asset, timeout=10)
        assert r.status_code == 200 and "://" not in r.text, asset
    for library in ("/webui/vendor/markdown-it.js", "/webui/vendor/purify.js"):  # the Markdown libraries it loads
        r = httpx.get(url + library, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript"), library
    assert httpx.get(url + "/webui/app.py", timeout=10).status_code == 404  # its files, nothing else


def test_the_api_docs_are_served_from_the_package(url):
    """/docs is Swagger UI from the package (FastAPI's own loads it from a CDN): every file it
    names is on this server, and ReDoc's page (also a CDN's) is off."""
    page = httpx.get(url + "/docs", timeout=10)
    assert page.status_code == 200 and "connect-src 'self'" in page.headers["content-security-policy"]
    for asset in ("/docs", "/docs/init.js"):
        assert "://" not in httpx.get(url + asset, timeout=10).text, asset
    for asset in ("/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css", "/docs/favicon-32x32.png"):
        assert httpx.get(url + asset, timeout=10).status_code == 200, asset
    assert httpx.get(url + "/redoc", timeout=10).status_code == 404


@pytest.mark.model
def test_no_webui_leaves_the_page_out(served):
    bare = wait_ready(served["bare"])
    for path in ("/", "/webui/app.js"):
        assert httpx.get(bare + path, timeout=10).status_code == 404, path
    assert httpx.get(bare + "/v1/models", timeout=10).status_code == 200  # the API is all there is


# ---------------------------------------------------------------- the page, in a real browser


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (as root: no sandbox). Missing, the test fails: .ci/run installs it."""
    assert os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER), \
        "Chromium is missing: apt-get install chromium chromium-driver (.ci/run does)"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,860"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})  # the network log: requested()
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


def wait_for(driver, what, timeout: float, message: str):
    """What `what()` returns once it is truthy, asked every 50 ms; a TimeoutException saying `message`."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: what(), message)


class Page:
    """The chat page in the browser, as a person uses it: its fields, buttons and what it shows."""

    def __init__(self, driver, url: str) -> None:
        self.driver = driver
        driver.get(url + "/")

    def el(self, id_: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.ID, id_)

    def wait(self, what, timeout: float, message: str):
        return wait_for(self.driver, what, timeout, message)

    def fill(self, id_: str, text: str) -> None:
        field = self.el(id_)
        field.clear()
        field.send_keys(text)

    def send(self, text: str) -> None:
        self.fill("input", text)
        self.el("send").click()

    def js(self, script: str):
        return self.driver.execute_script(script)

    def messages(self) -> list[str]:
        """The roles of the messages shown."""
        return self.js("return [...document.querySelectorAll('#messages .message')].map(m => m.classList[1])")

    def reply(self) -> dict:
        """The last reply as shown: its pieces [text, source] (the shaded spans) and the lines under it."""
        return self.js("""
            const m = [...document.querySelectorAll('#messages .message.assistant')].pop();
            if (!m) return null;
            return {pieces: [...m.querySelectorAll('.tok')].map(t => [t.textContent, t.classList[1]]),
                    lines: [...m.querySelectorAll('.figures, .error')].map(p => p.textContent)};""")


def finished(page: Page) -> dict | None:
    reply = page.reply()
    return reply if reply and reply["lines"] else None


@pytest.mark.model
def test_the_page_asks_for_the_key_then_streams_a_shaded_reply_with_its_figures(browser, url):
    page = Page(browser, url)
    page.wait(lambda: page.el("key-box").is_displayed(), 10, "the key's field did not show")  # /v1/models said 401
    page.send("Hello")
    page.wait(lambda: "401" in page.el("status").text, 10, "no 401 shown")
    assert page.messages() == [] and page.el("input").get_attribute("value") == "Hello"  # the message is kept

    page.fill("api-key", API_KEY + "\t")  # leaving the field stores it (session storage only)
    assert page.js("return sessionStorage.getItem('localspec.apiKey')") == API_KEY
    assert page.js("return localStorage.length") == 0
    page.fill("temperature", "0")
    page.fill("max-tokens", "40")
    question = "List the numbers from 1 to 30, separated by commas."
    # streamed: the shaded tokens grow, a few at a time, before the reply's figures show (counted
    # in the page every 5 ms, faster than any step)
    page.js("""window.seen = new Set(); window.sampler = setInterval(() => {
        const m = [...document.querySelectorAll('#messages .message.assistant')].pop();
        if (m && !m.querySelector('.figures')) seen.add(m.querySelectorAll('.tok').length); }, 5);""")
    page.send(question)
    reply = page.wait(lambda: finished(page), 60, "the reply did not finish")
    growing = set(page.js("clearInterval(sampler); return [...seen]")) - {0}
    assert len(growing) >= 3, f"the reply did not stream: {sorted(growing)}"
    assert page.messages() == ["user", "assistant"] and page.el("status").text == ""

    sources = {source for _, source in reply["pieces"]}
    assert sources <= SOURCES and "oracle" in sources and sources & {"draft", "lookup", "suffix"}
    expected = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": question}],
                                                  "max_tokens": 40, "temperature": 0})
    assert "".join(p for p, _ in reply["pieces"]) == expected["choices"][0]["message"]["content"]  # faithfully
    figures = reply["lines"][0]
    for words in (" tokens · ", " tok/s · acceptance ", "% · mean accepted length ", "speedup ~",
                  "x vs the oracle alone"):
        assert words in figures, figures
    legend = page.js("return [...document.querySelectorAll('#legend .tok')].map(t => t.classList[1])")
    assert legend == ["draft", "lookup", "suffix", "oracle"]
    live = page.wait(lambda: "tok/s" in page.el("live").text and page.el("live").text, 10, "no live panel")
    assert f"/{PARALLEL} in use" in live and "waiting 0" in live and "acceptance since start" in live, live


@pytest.mark.model
def test_the_api_docs_page_renders_with_nothing_from_elsewhere(browser, url):
    """Swagger UI in a real browser: the API's title and its endpoints drawn, and every resource the
    page loaded (scripts, styles, images, the OpenAPI document) came from this server."""
    browser.get(url + "/docs")
    ops = wait_for(browser, lambda: browser.execute_script(
        "return [...document.querySelectorAll('.opblock-summary-path')].map(e => e.textContent.trim())"),
        30, "Swagger UI drew no endpoints")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(ops)
    assert "localspec" in browser.execute_script("return document.querySelector('.info .title').textContent")
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert any(name.endswith("/openapi.json") for name in loaded)
    assert loaded and all(name.startswith(url + "/") for name in loaded), loaded


def test_stop_regenerate_speculation_off_and_new_chat(browser, url):
    page = Page(browser, url)  # the same tab's session: the key is still there
    page.wait(lambda: page.el("model").text, 10, "no model name: the key was not kept")
    assert not page.el("key-box").is_displayed()
    page.fill("temperature", "0")
    page.fill("max-tokens", "400")
    cancelled = metric(url, "localspec_generations_total", outcome="cancelled")
    page.send("Count from 1 to 300, separated by commas.")
    page.wait(lambda: len((page.reply() or {}).get("pieces", ())) >= 12, 60, "the reply did not start")
    page.el("stop").click()
    page.wait(lambda: not page.el("stop").is_enabled(), 10, "Stop did not stop")
    stopped = page.reply()
    assert stopped["lines"] == ["stopped"] and len(stopped["pieces"]) < 300
    # the server stopped generating too: the closed stream cancelled the generation within a step
    page.wait(lambda: metric(url, "localspec_generations_total", outcome="cancelled") == cancelled + 1, 10,
              "the generation was not cancelled")
    assert page.reply()["pieces"] == stopped["pieces"]  # nothing came after Stop

    page.fill("max-tokens", "8")
    page.el("regenerate").click()  # the stopped reply is replaced by a new one
    page.wait(lambda: finished(page) and finished(page)["lines"] != ["stopped"], 60, "no regenerated reply")
    assert page.messages() == ["user", "assistant"]
    assert "stopped at max tokens" in page.reply()["lines"][0]

    page.el("speculative").click()  # off: the oracle alone
    page.send("Hi")
    reply = page.wait(lambda: len(page.messages()) == 4 and finished(page), 60, "no reply without speculation")
    assert {source for _, source in reply["pieces"]} == {"oracle"} and "oracle alone" in reply["lines"][0]

    page.el("new-chat").click()
    assert page.messages() == [] and not page.el("regenerate").is_enabled()
    page.fill("max-tokens", "400")  # New chat in the middle of a reply: it stops, and leaves nothing behind
    page.send("Count from 1 to 300, separated by commas.")
    page.wait(lambda: len((page.reply() or {}).get("pieces", ())) >= 4, 60, "the reply did not start")
    page.el("new-chat").click()
    page.wait(lambda: not page.el("stop").is_enabled(), 10, "New chat did not stop the reply")
    assert page.messages() == [] and page.js("return chat.messages") == []


class _OtherSite(BaseHTTPRequestHandler):
    """A page of another origin that tries to drive the server: a text/plain POST (the classic
    cross-site request, no preflight) and a fetch with the API key (a preflight)."""

    target = ""

    def do_GET(self) -> None:
        body = json.dumps(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}))
        page = f"""<!doctype html><script>
            const url = {json.dumps(self.target + "/v1/chat/completions")};
            const attempts = [
              fetch(url, {{method: "POST", mode: "no-cors", headers: {{"Content-Type": "text/plain"}}, body: {body}}}),
              fetch(url, {{method: "POST", body: {body},
                          headers: {{"Content-Type": "application/json", "Authorization": "Bearer {API_KEY}"}}}}),
            ];
            Promise.allSettled(attempts).then(results => window.results = results.map(
              x => x.status === "fulfilled" ? x.value.type : String(x.reason)));
            </script>"""
        data = page.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def other_site(target: str) -> Iterator[str]:
    handler = type("Handler", (_OtherSite,), {"target": target})
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.model
def test_a_page_from_another_origin_still_cannot_drive_the_server(browser, url):
    generations = metric(url, "localspec_generations_total", outcome="completed")
    refused = metric(url, "localspec_requests_total", endpoint="/v1/chat/completions", status="403")
    with other_site(url) as site:
        browser.get(site)
        results = wait_for(browser, lambda: browser.execute_script("return window.results"), 10,
                           "the other site's page hung")
    # the POST went out (an opaque answer the page cannot read), the keyed one died at its preflight
    assert results[0] == "opaque" and results[1].startswith("TypeError"), results
    assert metric(url, "localspec_requests_total", endpoint="/v1/chat/completions", status="403") == refused + 2
    assert metric(url, "localspec_generations_total", outcome="completed") == generations  # nothing ran


def test_a_failure_in_the_middle_of_a_reply_shows_and_keeps_what_came(browser):
    """The engine fails on its second pass (a scripted engine, tests/serving.py): the stream's error
    event shows under the reply's first token, which stays in the conversation."""
    from localspec.server import create_app
    from localspec.server.errors import SERVER_ERROR

    server = ThreadedServer(create_app(paced_engine(fail="mid"), model_name="fake"))
    try:
        page = Page(browser, server.url)
        page.send("Hi")
        reply = page.wait(lambda: finished(page), 10, "no error shown")
        # drawn as Markdown, the paragraph loses its leading space; the conversation keeps it
        assert reply["pieces"] == [["1,", "oracle"]] and reply["lines"] == [SERVER_ERROR]
        assert page.js("return chat.messages") == [{"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": " 1,"}]
    finally:
        server.stop()


# ---------------------------------------------------------------- replies drawn as Markdown
#
# A model cannot be made to answer with a table, so these tests serve the page over the real
# engine and server with a scripted model that answers every message with a chosen reply: its
# tokens are the reply's words, spaces and signs, and a draft model (the same, but wrong at every
# seventh token) makes the stream carry both drafted and oracle tokens, as a real pair's does.

PROMPT_END = b"assistant\n"  # how ChatML's prompt ends (the scripted model has no template of its own)
FIRST = 3  # ids: BOS, EOS, PROMPT_END, then one per token of the reply
MISS_EVERY = 7

MARKDOWN_REPLY = """## Results

Call `speculate(k=4)` and **check** the table:

| Pair | Draft | Speedup |
|:-----|:-----:|--------:|
| SmolLM2 | 135M | 1.9x |
| Gemma 3 | 270M | 2.4x |

Steps:

1. load both models
2. verify in one batch

- fast
- exact

```python
def accept(p, q):
    return min(1, p / q)
```
"""

INJECTION_REPLY = """Here is <script>window.pwned=1</script> and <img src=x onerror="window.pwned=1"> too.

A [link](javascript:window.pwned=1), a <b onmouseover="window.pwned=1">bold</b>,
and an image: ![pixel](http://198.51.100.7/pixel.png)

| cell |
|---|
| <img src=y onerror="window.pwned=1"> |
"""


def replying_engine(reply: str, step: float = 0.005):
    """The real engine over a scripted oracle that answers any chat with `reply` (each pass `step`
    seconds, so that it streams), drafted for 4 tokens a step by a scripted draft that misses every
    MISS_EVERY-th token."""
    from scripted import BOS_TEXT, EOS, EOS_TEXT, ScriptedContext, ScriptedModel
    from serving import PacedContext

    from localspec.runtime.engine import Engine
    from localspec.speculative.policy import FixedLength
    from localspec.speculative.proposers import DraftModelProposer

    pieces = re.findall(r"\w+|\s|[^\w\s]", reply)
    assert "".join(pieces) == reply and "assistant" not in pieces
    model = ScriptedModel([BOS_TEXT, EOS_TEXT, PROMPT_END] + [p.encode() for p in pieces], name="replying")
    last = model.n_vocab - 1

    def logits(history, miss: bool = False):
        row = np.full(model.n_vocab, -100.0, dtype=np.float32)
        after = history[-1]
        nxt = FIRST if after == FIRST - 1 else after + 1 if FIRST <= after < last else EOS
        if miss and nxt != EOS and (nxt - FIRST) % MISS_EVERY == MISS_EVERY - 1:
            nxt = nxt + 1 if nxt < last else EOS  # the draft's guess skips a token: the oracle rejects it
        row[nxt] = 100.0
        return row

    oracle = PacedContext(model, logits, n_ctx=4096, step=step)
    draft = ScriptedContext(model, lambda history: logits(history, miss=True), n_ctx=4096)
    return Engine.from_parts(oracle=oracle, proposer=DraftModelProposer(draft), policy=FixedLength(4), draft=draft)


@contextmanager
def replying_server(reply: str) -> Iterator[str]:
    from localspec.server import create_app

    server = ThreadedServer(create_app(replying_engine(reply), model_name="replying"))
    try:
        yield server.url
    finally:
        server.stop()


def ask(page: Page) -> dict:
    """Send a message; the reply once finished."""
    page.send("Hi")
    return page.wait(lambda: finished(page), 20, "the reply did not finish")


def served_pieces(url: str) -> list[tuple[str, str]]:
    """The reply's [text, source] pieces as the server streams them to the page."""
    chunks = stream(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                   "speculative": {"sources": True}})
    return [tuple(p) for c in chunks for choice in c["choices"] if choice.get("speculative")
            for p in choice["speculative"]["sources"]]


def drawn(page: Page, selector: str = "") -> list[list[str]]:
    """The shaded spans [text, source] of the last reply (under `selector` in it, if given), in order."""
    return page.js(f"""
        const m = [...document.querySelectorAll('#messages .message.assistant')].pop();
        return [...m.querySelectorAll('.text {selector} .tok')].map(t => [t.textContent, t.classList[1]]);""")


def in_order(spans: list[list[str]], pieces: list[tuple[str, str]]) -> bool:
    """Whether each span is part of a piece with the same source, the pieces taken in order."""
    j = 0
    for text, source in spans:
        while j < len(pieces) and not (text in pieces[j][0] and pieces[j][1] == source):
            j += 1
        if j == len(pieces):
            return False
    return True


def test_a_markdown_reply_is_drawn_with_its_code_table_and_lists_and_keeps_its_shading(browser):
    with replying_server(MARKDOWN_REPLY) as url:
        pieces = served_pieces(url)
        assert {source for _, source in pieces} == {"draft", "oracle"}
        page = Page(browser, url)
        ask(page)
        body = "[...document.querySelectorAll('#messages .message.assistant .text')].pop()"
        shown = page.js(f"""const b = {body}; return {{
            heading: b.querySelector('h2').textContent,
            inline: [...b.querySelectorAll('p code')].map(c => c.textContent),
            strong: b.querySelector('strong').textContent,
            head: [...b.querySelectorAll('thead th')].map(c => [c.textContent, c.className]),
            rows: [...b.querySelectorAll('tbody tr')].map(r => [...r.cells].map(c => c.textContent)),
            ordered: [...b.querySelectorAll('ol li')].map(li => li.textContent),
            bullets: [...b.querySelectorAll('ul li')].map(li => li.textContent),
            code: b.querySelector('pre code').textContent,
            language: b.querySelector('pre code').className}}""")
        assert shown == {
            "heading": "Results", "inline": ["speculate(k=4)"], "strong": "check",
            "head": [["Pair", "align-left"], ["Draft", "align-center"], ["Speedup", "align-right"]],
            "rows": [["SmolLM2", "135M", "1.9x"], ["Gemma 3", "270M", "2.4x"]],
            "ordered": ["load both models", "verify in one batch"], "bullets": ["fast", "exact"],
            "code": "def accept(p, q):\n    return min(1, p / q)\n", "language": "language-python"}
        # the conversation keeps the reply's Markdown as it came
        assert page.js("return chat.messages")[-1] == {"role": "assistant", "content": MARKDOWN_REPLY}

        # every drawn character of the reply is shaded (Markdown's own syntax is not drawn), each
        # by the token it came from, and the shading runs through the table and the code block
        unshaded = page.js(f"""const b = {body}, out = [];
            const w = document.createTreeWalker(b, NodeFilter.SHOW_TEXT);
            while (w.nextNode()) {{ const n = w.currentNode;
              if (!n.parentElement.closest('.tok, button') && (n.data.trim() || n.parentElement.closest('pre')))
                out.push(n.data); }}
            return out;""")
        assert unshaded == []
        spans = drawn(page)
        assert in_order(spans, pieces)
        for part in ("table", "pre"):
            assert {source for _, source in drawn(page, part)} == {"draft", "oracle"}, part
        assert "".join(text for text, _ in drawn(page, "pre")) == shown["code"]
        assert page.js(f"return [...{body}.querySelectorAll('.tok')].every(t => t.title)")
        # drawn block by block as it streamed, it is what drawing the whole reply at once gives
        assert browser.execute_script(f"""const view = document.createElement('div');
            view.append(Object.assign(document.createElement('div'), {{className: 'text'}}));
            const whole = replyDrawing(view);
            drawSoon(whole, arguments[0]);
            drawNow(whole);
            return whole.body.innerHTML === {body}.innerHTML;""", pieces)


def test_a_code_block_has_a_copy_button_that_copies_its_code(browser):
    with replying_server(MARKDOWN_REPLY) as url:
        page = Page(browser, url)
        browser.execute_cdp_cmd("Browser.grantPermissions", {
            "origin": url, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
        ask(page)
        button = page.js("return [...document.querySelectorAll('#messages .code button.copy')]")
        assert len(button) == 1 and button[0].text == "Copy"
        button[0].click()
        page.wait(lambda: button[0].text == "Copied", 5, "the button did not say it copied")
        copied = browser.execute_async_script(
            "const done = arguments[0]; navigator.clipboard.readText().then(done, e => done(String(e)))")
        assert copied == "def accept(p, q):\n    return min(1, p / q)\n"


def test_a_reply_cannot_put_html_or_script_into_the_page(browser):
    """Raw HTML in a reply is text (markdown-it draws none), a javascript: link is no link, and an
    image is a link, fetched from nowhere; were HTML ever to get through, DOMPurify's list of the
    tags Markdown makes would drop it."""
    with replying_server(INJECTION_REPLY) as url:
        page = Page(browser, url)
        ask(page)
        time.sleep(0.3)  # time for anything that was to run
        assert page.js("return typeof window.pwned") == "undefined"
        found = page.js("""const b = [...document.querySelectorAll('#messages .message.assistant .text')].pop();
            return {elements: [...b.querySelectorAll('*')].map(e => e.tagName.toLowerCase()),
                    handlers: [...b.querySelectorAll('*')].flatMap(e => [...e.attributes].map(a => a.name))
                                .filter(name => name.startsWith('on')),
                    links: [...b.querySelectorAll('a')].map(a => [a.textContent, a.getAttribute('href'), a.rel]),
                    text: b.textContent};""")
        assert set(found["elements"]) <= {"p", "br", "a", "span", "div", "table", "thead", "tbody", "tr", "th", "td"}
        assert found["handlers"] == []
        assert found["links"] == [["pixel", "http://198.51.100.7/pixel.png", "noopener noreferrer"]]
        for shown in ('<script>window.pwned=1</script>', '<img src=x onerror="window.pwned=1">',
                      "[link](javascript:window.pwned=1)", '<img src=y onerror="window.pwned=1">'):
            assert shown in found["text"], shown
        # the second line of defence, on HTML markdown-it never makes
        assert page.js("""const f = DOMPurify.sanitize('<p>ok<img src=x onerror="window.pwned=1">'
                + '<script>window.pwned=1<\\/script><a href="javascript:window.pwned=1">a</a></p>', SANITIZE);
            const box = document.createElement('div'); box.append(f); return box.innerHTML;""") \
            == '<p>ok<a target="_blank" rel="noopener noreferrer">a</a></p>'


def requested(driver) -> list[str]:
    """The URLs the browser asked for since the last call, from its network log."""
    messages = (json.loads(entry["message"])["message"] for entry in driver.get_log("performance"))
    return [m["params"]["request"]["url"] for m in messages if m["method"] == "Network.requestWillBeSent"]


def test_no_request_from_the_page_or_the_api_docs_leaves_the_machine(browser):
    """From the browser's own network log: loading the page, a reply (one that names an image
    elsewhere) and its copy button, then /docs, asked this server for everything, and nothing else."""
    with replying_server(INJECTION_REPLY + "\n```\ncode\n```\n") as url:
        requested(browser)  # what earlier tests asked for
        page = Page(browser, url)
        ask(page)
        page.js("document.querySelector('#messages .code button.copy').click()")
        browser.get(url + "/docs")
        wait_for(browser, lambda: browser.execute_script("return document.querySelectorAll('.opblock').length"),
                 30, "Swagger UI drew no endpoints")
        urls = requested(browser)
    elsewhere = [u for u in urls if not (u.startswith(url + "/") or u.startswith(("data:", "blob:")))]
    assert elsewhere == []
    paths = {u[len(url):] for u in urls if u.startswith(url)}
    assert {"/", "/webui/app.js", "/webui/app.css", "/webui/vendor/markdown-it.js", "/webui/vendor/purify.js",
            "/v1/models", "/v1/chat/completions", "/docs", "/docs/swagger-ui-bundle.js", "/openapi.json"} <= paths


def page_overflow(page: Page) -> dict:
    """How many pixels the page, the conversation's box, and the last reply's last code block and
    table are wider than what shows of them; and the window's width."""
    return page.js("""const d = document.documentElement;
        const b = [...document.querySelectorAll('#messages .message.assistant .text')].pop();
        const over = e => e.scrollWidth - e.clientWidth, last = s => [...b.querySelectorAll(s)].pop();
        return {page: over(d), body: over(document.body), messages: over(document.getElementById('messages')),
                code: over(last('pre')), table: over(last('.table')), width: window.innerWidth};""")


WIDE_REPLY = MARKDOWN_REPLY + """
| Model | Draft model | Acceptance | Tokens per second | Speedup over the oracle alone |
|---|---|---|---|---|
| SmolLM2-1.7B-Instruct | SmolLM2-135M-Instruct | 0.81 | 42.0 | 1.9x |

```
localspec serve --model SmolLM2-1.7B-Instruct --draft SmolLM2-135M-Instruct --parallel 4 --ctx 4096
```
"""


def test_the_page_fits_a_phone_and_follows_the_dark_mode_of_the_system(browser):
    """At a phone's width (390 px) the page never scrolls sideways: a wide table and a long code
    line scroll inside their own boxes. In the system's dark mode the page, the reply and its code
    are dark; in its light mode, light."""
    def luminance(css: str) -> float:
        r, g, b = (int(x) for x in re.findall(r"\d+", css)[:3])
        return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255

    def colours(page: Page) -> dict:
        return page.js("""const c = e => getComputedStyle(document.querySelector(e));
            return {page: c('body').backgroundColor, text: c('body').color,
                    reply: c('#messages .message.assistant .text').backgroundColor,
                    code: c('#messages .text pre').backgroundColor};""")

    with replying_server(WIDE_REPLY) as url:
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                                {"width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": True})
        try:
            page = Page(browser, url)
            ask(page)
            fit = page_overflow(page)
            assert fit["width"] == 390 and fit["page"] == fit["body"] == fit["messages"] == 0, fit
            assert fit["code"] > 0 and fit["table"] > 0, fit  # the wide parts scroll on their own
            light = colours(page)
            browser.execute_cdp_cmd("Emulation.setEmulatedMedia",
                                    {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
            dark = colours(page)
        finally:
            browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})
            browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    assert all(luminance(light[part]) > 0.85 for part in ("page", "reply", "code")), light
    assert luminance(light["text"]) < 0.2, light
    assert all(luminance(dark[part]) < 0.2 for part in ("page", "reply", "code")), dark
    assert luminance(dark["text"]) > 0.85, dark
