"""localspec bench --clients: the workloads' requests (well-formed, the same every pass, the agent
loop's conversation growing turn by turn), the clients' queue and streaming against a stand-in
server, the servers' command lines, the report's shapes on synthetic runs, and one small real run
(localspec with and without the suffix cache, records twice). No timing assertions."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from localspec.runtime.learning import CostStore
from localspec.bench import client_workloads as cw
from localspec.bench import clients, clients_report

FIELDS = ("Name:", "Category:", "Price:", "Color:", "Material:", "Rating:")

# ------------------------------------------------------------------------------------ workloads


def test_records_are_32_listings_under_one_six_field_format():
    w = cw.build("records", 8)
    assert (w.name, len(w.conversations), w.passes, w.max_tokens) == ("records", 32, 2, 96)
    systems = {c.messages[0]["content"] for c in w.conversations}
    assert len(systems) == 1 and all(c.messages[0]["role"] == "system" for c in w.conversations)
    system = systems.pop()
    assert [line.split()[0] for line in system.splitlines()[-6:]] == list(FIELDS)
    assert len({json.dumps(c.messages[:-1]) for c in w.conversations}) == 1  # one worked example, the same
    example = w.conversations[0].messages[2]
    assert example["role"] == "assistant" and [line.split()[0] for line in example["content"].splitlines()] == list(FIELDS)
    listings = [c.messages[-1]["content"] for c in w.conversations]
    assert len(set(listings)) == 32 and all(c.messages[-1]["role"] == "user" for c in w.conversations)
    assert all(100 < len(text) < 400 and text.count(". ") >= 2 and "$" in text for text in listings)  # sentences, a price
    assert all(c.turns == 1 and c.request([]) == [dict(m) for m in c.messages] for c in w.conversations)
    assert w == cw.build("records", 1, rep=3)  # the same requests whatever the clients and the repetition
    small = cw.build("records", 2, max_prompts=4, max_tokens=24)
    assert small.conversations == w.conversations[:4] and small.max_tokens == 24


def test_the_agent_loop_grows_by_the_reply_and_a_fixed_tool_result_each_turn():
    w = cw.build("agent", 8)
    assert (len(w.conversations), w.passes, w.repeats) == (8, 1, 0)
    tools = [json.loads(line) for line in cw.AGENT_SYSTEM.splitlines() if line.startswith('{"name"')]
    assert {t["name"] for t in tools} >= {"search_products", "get_weather", "calculator"}
    c = w.conversations[0]
    assert c.turns == cw.AGENT_TURNS == 4
    replies = [f'{{"tool": "t{i}", "arguments": {{}}}}' for i in range(c.turns)]
    previous = c.request([])
    assert [m["role"] for m in previous] == ["system", *(["user", "assistant"] * 3), "user"]
    assert previous[0]["content"] == cw.AGENT_SYSTEM and previous[1:-1] == list(cw.AGENT_EXAMPLE)
    assert all(json.loads(m["content"])["tool"] for m in cw.AGENT_EXAMPLE if m["role"] == "assistant")
    for turn in range(1, c.turns):
        messages = c.request(replies[:turn])
        assert messages[:len(previous)] == previous  # what was sent before, then the reply and the tool result
        assert messages[len(previous):] == [{"role": "assistant", "content": replies[turn - 1]},
                                            {"role": "user", "content": c.followups[turn - 1]}]
        assert messages[-1]["content"].startswith("Tool result: ")
        json.loads(messages[-1]["content"].removeprefix("Tool result: "))
        previous = messages
    with pytest.raises(ValueError):
        c.request(replies)
    assert w == cw.build("agent", 8, rep=1)
    assert len({c.messages[-1]["content"] for c in w.conversations}) == 8  # a task per client
    assert cw.build("agent", 9).repeats == 1
    assert cw.build("agent", 2, turns=2).conversations[0].turns == 2


def test_open_prompts_and_the_warm_up_share_nothing_with_the_workloads():
    first, second = cw.build("open", 8), cw.build("open", 8, rep=1)
    asked = lambda w: {m["content"] for c in w.conversations for m in c.messages}  # noqa: E731
    assert len(asked(first)) == 8 and not asked(first) & asked(second) and first.max_tokens == 256
    warm = asked(clients.warmup_workload(8))
    assert warm and not warm & (asked(first) | asked(second) | asked(cw.build("records", 8)) | asked(cw.build("agent", 8)))
    with pytest.raises(ValueError, match="workloads"):
        cw.build("nope", 1)


# ------------------------------------------------------------------------------------ a stand-in server


def _answer(messages: list[dict]) -> list[str]:
    """The stand-in's deterministic reply to a conversation, in pieces."""
    digest = hashlib.sha1(json.dumps(messages).encode()).hexdigest()[:6]
    return [f"reply{len(messages)}", f"-{digest}", " end"]


class StandIn(BaseHTTPRequestHandler):
    seen: list[list[dict]] = []
    accepted = 0.0

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body["messages"])
        assert body["temperature"] == 0 and body["stream"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        pieces = _answer(body["messages"])
        for piece in pieces:
            self.wfile.write(f"data: {json.dumps({'choices': [{'delta': {'content': piece}}]})}\n\n".encode())
        usage = {"completion_tokens": len(pieces) + 1, "drafted": 4, "accepted": 3}
        type(self).accepted += 3
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())

    def do_GET(self):
        text = ("# HELP localspec_spec_decode_num_accepted_tokens_by_source_total x\n"
                "# TYPE localspec_spec_decode_num_accepted_tokens_by_source_total counter\n"
                f'localspec_spec_decode_num_accepted_tokens_by_source_total{{source="suffix"}} {type(self).accepted}\n')
        self.send_response(200)
        self.end_headers()
        self.wfile.write(text.encode())


@pytest.fixture
def stand_in():
    StandIn.seen, StandIn.accepted = [], 0.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_clients_work_through_the_records_as_one_queue(stand_in):
    w = cw.build("records", 3, max_prompts=7)
    result = clients.run_pass(stand_in, "m", w, 3)
    assert [r.conversation for r in result.replies] == [c.id for c in w.conversations]  # each once, in order
    assert sorted(map(json.dumps, StandIn.seen)) == sorted(json.dumps(c.request([])) for c in w.conversations)
    assert all(r.error is None and r.text == "".join(_answer(c.request([]))) and r.tokens == 4
               and (r.drafted, r.accepted) == (4, 3) and 0 <= r.start < r.end <= result.wall
               for r, c in zip(result.replies, w.conversations))
    assert result.tokens == 28 and result.aggregate == pytest.approx(28 / result.wall)


def test_each_agent_turn_sends_the_conversation_with_the_last_reply(stand_in):
    w = cw.build("agent", 2, turns=3)
    result = clients.run_pass(stand_in, "m", w, 2)
    assert [(r.conversation, r.turn) for r in result.replies] == [("agent-01", t) for t in range(3)] + [
        ("agent-02", t) for t in range(3)]
    for c in w.conversations:
        texts = [r.text for r in result.replies if r.conversation == c.id]
        assert [c.request(texts[:t]) for t in range(3)] == [m for m in StandIn.seen if m[7] == c.messages[7]]
    row = clients.pass_row("localspec", w, 2, 0, 1, result, {"suffix": {"drafted": 8.0, "accepted": 6.0}})
    assert len(row["ttft_p50_by_turn"]) == 3 and row["drafted"] == 24 and row["accepted"] == 18
    assert [(q["conversation"], q["turn"]) for q in row["requests"]] == [(r.conversation, r.turn) for r in result.replies]
    json.dumps(row)


def test_a_pass_counts_what_the_suffix_cache_drafted_from_metrics(stand_in):
    before = clients.metrics_by_source(stand_in)
    clients.run_pass(stand_in, "m", cw.build("records", 2, max_prompts=2), 2)
    after = clients.metrics_by_source(stand_in)
    assert before == {"suffix": {"drafted": 0.0, "accepted": 0.0}}
    assert clients._difference(after, before) == {"suffix": {"drafted": 0.0, "accepted": 6.0}}
    assert clients._difference(before, before) == {}


def test_a_failed_request_ends_its_conversation_and_is_reported():
    w = cw.build("agent", 1)
    result = clients.run_pass("http://127.0.0.1:9", "m", w, 1, timeout=5)  # nothing listens there
    assert len(result.replies) == 1 and result.replies[0].error and result.tokens == 0


# ------------------------------------------------------------------------------------ servers


@pytest.mark.parametrize("system,spec", [("llama-server", None), ("llama-server-draft", "draft-simple"),
                                         ("llama-server-ngram-mod", "ngram-mod"),
                                         ("llama-server-ngram-cache", "ngram-cache"),
                                         ("llama-server-ngram-mod-draft", "ngram-mod,draft-simple"),
                                         ("llama-server-ngram-cache-draft", "ngram-cache,draft-simple")])
def test_llama_server_systems_name_their_speculative_types(tmp_path, system, spec):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    argv = clients.server_argv(system, port=1, n_slots=8, oracle="o.gguf", draft="d.gguf", threads=2,
                               anchor_bin=str(tmp_path), model_name="m", ctx_per_slot=2048)
    assert argv[0] == str(binary) and argv[argv.index("-np") + 1] == "8" and argv[argv.index("-c") + 1] == "16384"
    assert (argv[argv.index("--spec-type") + 1] if "--spec-type" in argv else None) == spec
    assert ("-md" in argv) == ("draft-simple" in (spec or "")) and ("d.gguf" in argv) == ("-md" in argv)
    if "draft-simple" in (spec or ""):
        with pytest.raises(clients.ServingError, match="no draft"):
            clients.server_argv(system, port=1, n_slots=8, oracle="o.gguf", draft=None, threads=2,
                                anchor_bin=str(tmp_path), model_name="m")


def test_localspec_systems():
    argv = lambda s: clients.server_argv(s, port=1, n_slots=4, oracle="o", draft="d", threads=2,  # noqa: E731
                                         anchor_bin=None, model_name="m", ctx_per_slot=2048)
    assert "--suffix-cache-tokens" not in argv("localspec") and argv("localspec")[-2:] == ["--draft", "d"]
    assert argv("localspec-no-suffix")[-4:] == ["--suffix-cache-tokens", "0", "--draft", "d"]
    assert argv("localspec-no-prompt-cache")[-4:] == ["--prompt-cache-mib", "0", "--draft", "d"]
    assert argv("localspec-no-caches")[-6:] == ["--suffix-cache-tokens", "0", "--prompt-cache-mib", "0", "--draft", "d"]
    assert "--no-draft" in argv("localspec-no-draft") and "d" not in argv("localspec-no-draft")
    one = argv("localspec-no-draft-1-thread")  # click takes an option's last value: one thread
    assert "--no-draft" in one and "d" not in one and one[-2:] == ["--threads", "1"]
    assert argv("localspec")[argv("localspec").index("--ctx") + 1] == "2048"
    assert set(clients.SYSTEMS) == {*clients.LOCALSPEC_SYSTEMS, *clients.LLAMA_SERVER_SYSTEMS}
    with pytest.raises(clients.ServingError):
        argv("vllm")


def test_localspec_base_is_served_from_the_checkout_it_names(tmp_path):
    """`bench --clients --base-tree DIR`: the system localspec-base runs DIR's localspec (its
    package first on the path, DIR the working directory), with the same command line, learning in
    the cost cache it is handed."""
    tree = tmp_path / "tree"
    (tree / "localspec" / "cli").mkdir(parents=True)
    (tree / "localspec" / "__init__.py").write_text("")
    (tree / "localspec" / "cli" / "__init__.py").write_text("")
    (tree / "localspec" / "cli" / "__main__.py").write_text(
        "import json, os, sys, localspec\n"
        f"open({str(tmp_path / 'ran.json')!r}, 'w').write(json.dumps([os.getcwd(), localspec.__file__, sys.argv[1:],"
        " os.environ.get('LOCALSPEC_COST_CACHE')]))\n")
    kw = dict(n_slots=2, oracle="o", draft="d", threads=2, anchor_bin=None, model_name="m")
    server = clients.start_server("localspec-base", base_tree=str(tree), costs=str(tmp_path / "costs"), **kw)
    try:
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()
    cwd, package, args, costs = json.loads((tmp_path / "ran.json").read_text())
    assert cwd == str(tree.resolve()) and package == str(tree.resolve() / "localspec" / "__init__.py")
    assert costs == str(tmp_path / "costs")
    assert args[0] == "serve" and args[args.index("--parallel") + 1] == "2" and args[-2:] == ["--draft", "d"]
    for missing in (None, str(tmp_path)):  # no tree, or a folder that is not a checkout
        with pytest.raises(clients.ServingError, match="--base-tree"):
            clients.start_server("localspec-base", base_tree=missing, **kw)


# ------------------------------------------------------------------------------------ the report


def _row(workload, system, rep, number, agg, texts, *, suffix=None, turns=1):
    requests = [{"conversation": f"c{i}", "turn": t, "text": text, "tokens": 10, "ttft": 0.1 * (t + 1),
                 "start": 0.0, "end": 1.0, "drafted": None, "accepted": None, "error": None}
                for i, text in enumerate(texts) for t in range(turns)]
    return {"workload": workload, "clients": 2, "system": system, "rep": rep, "pass": number,
            "aggregate_tokens_per_second": agg, "tokens": 10 * len(requests), "wall": 1.0, "errors": [],
            "ttft_p50": 0.1, "ttft_p95": 0.2, "ttft_p50_by_turn": [0.1 * (t + 1) for t in range(turns)],
            "client_tokens_per_second": [20.0] * len(requests), "drafted": 40 if suffix is not None else None,
            "accepted": 30 if suffix is not None else None,
            "by_source": None if suffix is None else {"suffix": {"drafted": suffix, "accepted": suffix}} if suffix else {},
            "requests": requests}


def _report(rows):
    return {"schema": clients.SCHEMA, "machine": {"cpu": "cpu", "threads": 2},
            "config": {"oracle": "/m/o.gguf", "draft": "/m/d.gguf", "clients": [2], "systems": [], "reps": 2,
                       "threads": 2, "max_tokens": None,
                       "workloads": {"records": cw.build("records", 2, max_prompts=2).to_dict()}},
            "runs": rows, "batched_bench": {2: 50.0}, "summary": clients_report.summarize(rows, {2: 50.0}),
            "notes": ["a note"]}


def test_the_summary_sets_pass_2_against_pass_1_and_each_system_against_the_others():
    rows = []
    for rep, (p1, p2) in enumerate([(100.0, 250.0), (110.0, 330.0)]):
        rows += [_row("records", "localspec", rep, 1, p1, ["a", "b"], suffix=0.0),
                 _row("records", "localspec", rep, 2, p2, ["a", "b"], suffix=50.0),
                 _row("records", "localspec-no-suffix", rep, 1, 100.0, ["a", "b"], suffix=0.0),
                 _row("records", "localspec-no-suffix", rep, 2, 100.0, ["a", "x"], suffix=0.0),
                 _row("records", "llama-server-ngram-mod", rep, 1, 80.0, ["a", "b"]),
                 _row("records", "llama-server-ngram-mod", rep, 2, 125.0, ["a", "b"])]
    summary = {(s["system"], s["pass"]): s for s in clients_report.summarize(rows, {2: 50.0})}
    mine = summary["localspec", 2]
    assert mine["aggregate_tokens_per_second"] == 290.0 and mine["vs_pass_1"] == pytest.approx((2.5 + 3.0) / 2)
    assert mine["vs_llama_server_best"] == pytest.approx(290 / 125) and mine["vs_localspec_before"] == 2.9
    assert mine["suffix_accepted"] == 50.0 and mine["accepted"] == 30 and mine["same_text_as_pass_1"] == 1.0
    assert summary["localspec-no-suffix", 2]["same_text_as_first_system"] == 0.5
    assert summary["localspec-no-suffix", 2]["same_text_as_pass_1"] == 0.5
    assert summary["llama-server-ngram-mod", 1]["suffix_accepted"] is None
    assert summary["localspec", 1]["vs_pass_1"] is None and summary["localspec", 1]["batched_bench"] == 50.0


def test_the_markdown_table_has_the_workload_both_passes_and_turns():
    rows = [_row("records", "localspec", 0, 1, 100.0, ["a"], suffix=0.0),
            _row("records", "localspec", 0, 2, 250.0, ["a"], suffix=9.0),
            _row("agent", "localspec", 0, 1, 120.0, ["a", "b"], suffix=3.0, turns=4),
            _row("agent", "llama-server", 0, 1, 90.0, ["a", "b"], turns=4)]
    report = _report(rows)
    json.dumps(report)
    text = clients_report.markdown(report)
    assert "| workload | clients | system | pass | aggregate tok/s | vs pass 1 |" in text
    assert "| records | 2 | localspec | 2 | 250.0 | 2.50x |" in text
    assert "| records | 2 | localspec | 1 | 100.0 | – |" in text and "30 (9)" in text
    assert "| agent | 2 | localspec | 0.10 | 0.20 | 0.30 | 0.40 |" in text  # first token by turn
    server_row = next(line for line in text.splitlines() if line.startswith("| agent | 2 | llama-server | 1 | 90.0 |"))
    assert "| 1.00x |" in server_row and "(" not in server_row  # no suffix cache count from llama-server
    assert "| agent | 2 | localspec | 1 | 120.0 | – | 1.33x |" in text
    assert text.rstrip().endswith("- a note") and clients.SCHEMA == "localspec-bench-clients/2"


def test_the_cli_checks_its_choices():
    from localspec.bench import command

    assert command._client_counts("8,1, 8") == [1, 8]
    assert command._names(None, clients.SYSTEMS, "systems") == list(clients.SYSTEMS)
    assert command._names("agent,records", cw.CLIENT_WORKLOADS, "workloads") == ["agent", "records"]
    with pytest.raises(ValueError, match="not chat"):
        command._names("open,chat", cw.CLIENT_WORKLOADS, "workloads")
    with pytest.raises(ValueError):
        command._client_counts("0")
    assert "localspec-base" not in command._client_systems(None, None)  # it needs a checkout to serve from
    assert command._client_systems(None, "/tree") == [s for s in clients.SYSTEMS if s != "localspec-no-draft-1-thread"]
    assert "localspec-no-draft-1-thread" in command._client_systems("localspec-no-draft-1-thread", None)  # when named
    assert command._client_systems("localspec-base,localspec", "/tree") == ["localspec-base", "localspec"]
    with pytest.raises(ValueError, match="--base-tree"):
        command._client_systems("localspec-base", None)


def test_the_report_sets_each_system_against_localspec_base_where_it_ran():
    rows = [_row("agent", "localspec-base", 0, 1, 40.0, ["a", "b"], turns=4),
            _row("agent", "localspec", 0, 1, 60.0, ["a", "b"], suffix=3.0, turns=4)]
    summary = {s["system"]: s for s in clients_report.summarize(rows, {2: 50.0})}
    assert summary["localspec"]["vs_localspec_base"] == 1.5 and summary["localspec-base"]["vs_localspec_base"] == 1.0
    text = clients_report.markdown(_report(rows))
    assert "| vs localspec before its caches | vs localspec-base | first token p50 |" in text
    assert "| agent | 2 | localspec | 1 | 60.0 | – | – | – | 1.50x | 0.10 s |" in text
    assert "vs localspec-base" not in clients_report.markdown(_report(rows[1:]))  # no column where it did not run


# ------------------------------------------------------------------------------------ a real run


@pytest.mark.model
def test_records_twice_on_localspec_with_and_without_the_suffix_cache(pair_paths):
    """Pass 2 of localspec (the same requests again) drafts from the suffix cache; the server
    without it does not; every answer is the same text in both passes and on both systems."""
    oracle, draft = pair_paths
    config = clients.ClientsConfig(oracle=str(oracle), draft=str(draft), clients=[2],
                                   systems=["localspec", "localspec-no-suffix"], workloads=["records"], reps=1,
                                   threads=2, max_tokens=24, max_prompts=4)
    costs = Path(os.environ["LOCALSPEC_COST_CACHE"])  # the suite's cost cache: the user's, here
    CostStore.flush()  # (what this process's earlier engines handed the writer is not the run's doing)
    before = {p.name: p.read_bytes() for p in costs.glob("*.json")} if costs.is_dir() else {}
    report = clients.run_clients_bench(config, reference=False)
    assert not report["notes"], report["notes"]
    # each server learned in a copy of the cache as the run found it: the user's is as it was
    assert ({p.name: p.read_bytes() for p in costs.glob("*.json")} if costs.is_dir() else {}) == before
    rows = {(r["system"], r["pass"]): r for r in report["runs"]}
    assert set(rows) == {(s, p) for s in config.systems for p in (1, 2)}
    assert all(not r["errors"] and len(r["requests"]) == 4 and r["tokens"] > 0 for r in rows.values())
    assert rows["localspec", 2]["by_source"].get("suffix", {}).get("accepted", 0) > 0
    assert all("suffix" not in rows["localspec-no-suffix", p]["by_source"] for p in (1, 2))
    texts = {key: [q["text"] for q in r["requests"]] for key, r in rows.items()}
    assert all(t for t in texts["localspec", 1]) and len(set(map(tuple, texts.values()))) == 1
    summary = {(s["system"], s["pass"]): s for s in report["summary"]}
    assert summary["localspec", 2]["vs_pass_1"] > 0 and summary["localspec", 2]["same_text_as_first_system"] == 1.0
    assert "| records | 2 | localspec | 2 |" in clients_report.markdown(report)
