"""`localspec generate --input/--output`: request parsing, the resumable output file, a run against
a scripted engine (fast), then round trips and a resume on the default pair."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import deque
from types import SimpleNamespace

import pytest

from localspec.cli.jobs import parse_line, read_done, run_batch
from localspec.options import OPTIONS, GenerationOptions
from localspec.outputs import Stats
from localspec.runtime.sequence import PromptTooLongError, Status

CLI = [sys.executable, "-m", "localspec.cli"]
DEFAULTS = GenerationOptions(max_tokens=16, top_k=40)  # the command line's


def parse(obj_or_text, lineno=1, system=None, raw=False):
    line = obj_or_text if isinstance(obj_or_text, str) else json.dumps(obj_or_text)
    return parse_line(line, lineno, defaults=DEFAULTS, system=system, raw=raw)


# ---------------------------------------------------------------- parsing


def test_a_prompt_is_a_chat_message_unless_raw():
    item = parse({"id": "a", "prompt": "hi"}, system="be brief")
    assert item.error is None and item.id == "a"
    assert item.prompt == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert parse({"id": "a", "prompt": "hi", "raw": True}, system="be brief").prompt == "hi"
    assert parse({"id": "a", "prompt": "hi"}, raw=True).prompt == "hi"  # --raw
    assert parse({"id": "a", "prompt": "hi", "raw": False}, raw=True).prompt == [{"role": "user", "content": "hi"}]
    msgs = [{"role": "user", "content": "x"}]
    assert parse({"id": 7, "messages": msgs}, system="ignored for messages").prompt == msgs


def test_line_sampling_fields_override_the_command_line():
    item = parse({"id": 1, "prompt": "hi", "max_tokens": 4, "temperature": 0.7, "seed": 3, "stop": ["\n"]})
    assert item.options == GenerationOptions(max_tokens=4, temperature=0.7, top_k=40, seed=3, stop="\n")
    assert parse({"id": 2, "prompt": "hi"}).options is DEFAULTS  # nothing changed: the same, checked once


@pytest.mark.parametrize("line, record_id, message", [
    ("{not json", "line-5", "line 5: not valid JSON"),
    ("[1, 2]", "line-5", "expected a JSON object"),
    ('{"prompt": "hi"}', "line-5", 'missing "id"'),
    ('{"id": true, "prompt": "hi"}', "line-5", '"id" must be a string or an integer'),
    ('{"id": "x"}', "x", 'exactly one of "prompt" and "messages"'),
    ('{"id": "x", "prompt": "a", "messages": []}', "x", 'exactly one of'),
    ('{"id": "x", "prompt": ""}', "x", '"prompt" must be a non-empty string'),
    ('{"id": "x", "messages": "hi"}', "x", '"messages" must be a non-empty list'),
    ('{"id": "x", "messages": [{"role": "user", "content": "a"}], "raw": true}', "x", '"raw" applies to "prompt"'),
    ('{"id": "x", "prompt": "a", "temprature": 1}', "x", "unknown field 'temprature'"),
    ('{"id": "x", "prompt": "a", "max_tokens": "9"}', "x", f'{OPTIONS["max_tokens"].rule}, got "9"'),
    ('{"id": "x", "prompt": "a", "max_tokens": null}', "x", f'{OPTIONS["max_tokens"].rule}, got null'),
    ('{"id": "x", "prompt": "a", "top_k": true}', "x", f'{OPTIONS["top_k"].rule}, got true'),
    ('{"id": "x", "prompt": "a", "temperature": -1}', "x", f'{OPTIONS["temperature"].rule}, got -1'),
    ('{"id": "x", "prompt": "a", "stop": [1]}', "x", f'{OPTIONS["stop"].rule}, got [1]'),
    ('{"id": "x", "prompt": "a", "grammar": null}', "x", f'{OPTIONS["grammar"].rule}, got null'),
])
def test_malformed_lines_become_error_items(line, record_id, message):
    item = parse(line, lineno=5)
    assert item.id == record_id and item.error is not None and message in item.error, item.error


# ---------------------------------------------------------------- the output file


def test_read_done_cuts_a_truncated_last_line_and_ignores_unreadable_ones(tmp_path):
    out = tmp_path / "out.jsonl"
    good = '{"id": "a", "text": "x"}\n{"id": 2, "error": "e"}\nnot json\n'
    out.write_text(good + '{"id": "c", "te')
    warnings = []
    done = read_done(str(out), warnings.append)
    assert done == {'"a"': "x", "2": None}  # each id, and its text (None: an error record)
    assert out.read_text() == good  # repaired: appending starts on a fresh line
    assert any("truncated last line" in w for w in warnings) and any("1 unreadable line" in w for w in warnings)
    assert read_done(str(tmp_path / "missing.jsonl"), warnings.append) == {}


class FakeSeq:
    """What the runner reads of an engine's sequence: it finishes at its first step, its text the
    prompt's in capitals."""

    def __init__(self, text: str) -> None:
        self.text = SimpleNamespace(text=text.upper())
        self.stats = Stats(completion_tokens=3, steps=2, drafted=4, accepted=3, total_time=0.1)
        self.status, self.finish_reason, self.structure, self.outbox = Status.WAITING, None, None, deque()

    @property
    def done(self):
        return self.status in (Status.FINISHED, Status.ABORTED)


class FakeScheduler:
    def __init__(self) -> None:
        self.seqs = []

    def add(self, seq):
        self.seqs.append(seq)
        return seq

    def step(self):
        for seq in self.seqs:
            seq.status, seq.finish_reason = Status.FINISHED, "stop"
        self.seqs = []

    def abort(self, seq):
        seq.status = Status.ABORTED


class FakeEngine:
    """The engine's batch interface (prepare, a scheduler, its slots) over instant generations."""

    n_slots = 2
    suffix = None  # no suffix cache to start from earlier answers

    def __init__(self) -> None:
        self.prompts = []
        self.opened = 0
        self.scheduler = FakeScheduler()

    def __enter__(self):
        self.opened += 1
        return self

    def __exit__(self, *exc):
        pass

    def prepare(self, prompt, options):
        assert isinstance(options, GenerationOptions)
        text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        if len(text) > 20:
            raise PromptTooLongError(f"the prompt has {len(text)} tokens; the context holds 20")
        self.prompts.append(prompt)
        return FakeSeq(prompt if isinstance(prompt, str) else prompt[-1]["content"])


def write_lines(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def records(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def test_a_run_writes_each_record_as_it_finishes_and_a_rerun_does_only_the_missing_ids(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [{"id": "a", "prompt": "one"}, "oops", {"id": "b", "prompt": "two" * 10},
                      "", {"id": "c", "prompt": "three", "raw": True}, {"id": "a", "prompt": "again"}])
    engine = FakeEngine()
    notes = []
    summary = run_batch(str(inp), str(out), open_engine=lambda: engine, defaults=DEFAULTS, progress=notes.append)
    got = {r["id"]: r for r in records(out)}
    # a malformed line's record as it is reached, a generation's when it finishes (a and c: two slots)
    assert list(got) == ["line-2", "b", "a", "c"]
    assert got["a"]["text"] == "ONE" and got["a"]["finish_reason"] == "stop" and got["a"]["stats"]["accepted"] == 3
    assert "not valid JSON" in got["line-2"]["error"] and "the context holds 20" in got["b"]["error"]
    assert got["c"]["text"] == "THREE" and engine.prompts[1] == "three"  # raw: the plain string
    assert (summary.written, summary.failed, summary.duplicates, summary.tokens) == (4, 2, 1, 6)
    assert notes[-1].startswith("4 records written (2 failed), 1 repeated id skipped; 6 tokens")
    assert "acceptance 75%" in notes[-1]

    # a crash left half a record; the rerun cuts it, and only the missing ids run
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:1] + lines[2:3]) + lines[3][:25])  # line-2, a, then half of c ("b" lost)
    engine2 = FakeEngine()
    summary = run_batch(str(inp), str(out), open_engine=lambda: engine2, defaults=DEFAULTS, progress=notes.append)
    assert [r["id"] for r in records(out)] == ["line-2", "a", "b", "c"]
    assert engine2.prompts == ["three"] and summary.skipped == 3  # line-2, a and the repeated a

    # everything done: the models are not even loaded
    summary = run_batch(str(inp), str(out), open_engine=lambda: pytest.fail("engine opened"), defaults=DEFAULTS,
                        progress=notes.append)
    assert summary.written == 0 and notes[-1].startswith("nothing to do")


def test_input_is_utf8_line_by_line_with_an_optional_bom(tmp_path):
    """A line that is not UTF-8 is an error record naming the line (not a prompt with U+FFFD in it);
    a BOM at the start of the file is not part of the first line; U+2028 inside a JSON string and
    CRLF line ends do not split a line."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"\xef\xbb\xbf" + json.dumps({"id": "a", "prompt": "one"}).encode() + b"\r\n"
                    + b'{"id": "b", "prompt": "caf\xe9 \xff"}\n'
                    + json.dumps({"id": "c", "prompt": "x\u2028y", "raw": True}, ensure_ascii=False).encode() + b"\n")
    engine = FakeEngine()
    notes = []
    summary = run_batch(str(inp), str(out), open_engine=lambda: engine, defaults=DEFAULTS, progress=notes.append)
    got = {r["id"]: r for r in records(out)}
    assert sorted(got) == ["a", "c", "line-2"], got
    assert got["a"]["text"] == "ONE"
    assert got["line-2"]["error"] == "line 2: not valid UTF-8 (byte 0xe9 at byte 27 of the line)"
    assert got["c"]["text"] == "X\u2028Y" and engine.prompts[1] == "x\u2028y"
    assert (summary.written, summary.failed, summary.ok) == (3, 1, False)


def run_batch_cli(*args, timeout=60):
    return subprocess.run(CLI + ["generate", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_the_exit_status_says_when_records_failed(tmp_path):
    """Without a model: lines that all fail to parse never load the engine. 1 when any id of the
    input has an error record in the output (written now or by an earlier run), 0 when none has."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, ["{broken", {"id": "x"}])
    p = run_batch_cli("--input", str(inp), "--output", str(out))
    assert p.returncode == 1, p.stderr
    assert "2 records written (2 failed)" in p.stderr and "Traceback" not in p.stderr
    assert [r["id"] for r in records(out)] == ["line-1", "x"]

    p = run_batch_cli("--input", str(inp), "--output", str(out))  # a rerun skips them, and still says so
    assert p.returncode == 1, p.stderr
    assert "2 of them error records" in p.stderr

    out.write_text(json.dumps({"id": "line-1", "text": "ok", "finish_reason": "stop", "stats": {}}) + "\n"
                   + json.dumps({"id": "x", "text": "ok", "finish_reason": "stop", "stats": {}}) + "\n")
    p = run_batch_cli("--input", str(inp), "--output", str(out))
    assert p.returncode == 0, p.stderr
    assert "nothing to do" in p.stderr


# ---------------------------------------------------------------- the real command


def run_cli(*args, timeout=120):
    return subprocess.run(CLI + ["generate", "--threads", "1", "--max-tokens", "12", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.model
def test_batch_round_trip_and_resume(tmp_path):
    inp, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    write_lines(inp, [
        {"id": "capital", "prompt": "What is the capital of France? One sentence."},
        {"id": 2, "messages": [{"role": "system", "content": "Answer in one word."},
                               {"role": "user", "content": "What color is the sky?"}], "max_tokens": 4},
        '{"id": "broken", "prompt": ',
        {"id": "cold", "prompt": "x", "top_p": 0},
        {"id": "raw", "prompt": "The sea is", "raw": True, "max_tokens": 6, "temperature": 0.8, "seed": 1},
    ])
    p = run_cli("--input", str(inp), "--output", str(out))
    assert p.returncode == 1, p.stderr  # two records failed
    assert "Traceback" not in p.stderr and "\x1b" not in p.stderr and p.stdout == ""
    got = {r["id"]: r for r in records(out)}  # each record as it finished
    assert sorted(got, key=str) == [2, "capital", "cold", "line-3", "raw"]
    assert "Paris" in got["capital"]["text"] and got["capital"]["finish_reason"] in ("stop", "length")
    assert set(got["capital"]) == {"id", "text", "finish_reason", "stats"}
    assert got["capital"]["stats"]["completion_tokens"] > 0 and "acceptance_rate" in got["capital"]["stats"]
    assert got[2]["stats"]["completion_tokens"] <= 4 and got["raw"]["stats"]["completion_tokens"] <= 6
    assert "not valid JSON" in got["line-3"]["error"] and "top_p" in got["cold"]["error"]
    summary = p.stderr.strip().splitlines()[-1]
    assert summary.startswith("localspec: 5 records written (2 failed);") and "tok/s" in summary, p.stderr

    # an interrupted run: "capital" written, the next record cut mid-line; the rerun does the rest only
    kept = out.read_text().splitlines(keepends=True)
    first = got["capital"] | {"text": "FROM THE FIRST RUN"}
    second = next(line for line in kept if json.loads(line)["id"] != "capital")
    out.write_text(json.dumps(first) + "\n" + second[:30])
    p = run_cli("--input", str(inp), "--output", str(out))
    assert p.returncode == 1, p.stderr
    assert "dropped a truncated last line" in p.stderr and "1 skipped (already in the output)" in p.stderr
    again = records(out)  # every line parses again
    assert sorted((r["id"] for r in again), key=str) == [2, "capital", "cold", "line-3", "raw"]
    assert again[0]["text"] == "FROM THE FIRST RUN"  # not regenerated
    assert "4 records written (2 failed)" in p.stderr


@pytest.fixture(scope="module")
def not_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "notes.gguf"
    path.write_text("this is not a model\n")
    return path


@pytest.mark.parametrize("args, message", [
    (["--oracle", "no-such-model", "--no-draft"], "unknown model 'no-such-model'"),
    (["--oracle", "{not_gguf}", "--no-draft"], "not a GGUF file"),
    (["--oracle", "/nonexistent/model.gguf", "--no-draft"], "not found"),
])
def test_bad_models_give_one_line_and_exit_code_2(args, message, not_gguf, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [{"id": 1, "prompt": "hi"}])
    p = run_cli("--input", str(inp), "--output", str(out), *[a.replace("{not_gguf}", str(not_gguf)) for a in args])
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("localspec: error:") and message in lines[0], p.stderr
    assert "Traceback" not in p.stderr and not out.exists()


def test_batch_usage_errors(tmp_path):
    inp = tmp_path / "in.jsonl"
    write_lines(inp, [{"id": 1, "prompt": "hi"}])
    p = run_cli("hello", "--input", str(inp))
    assert p.returncode == 2 and p.stderr.strip() == "localspec: error: give either PROMPT or --input, not both"
    p = run_cli("--output", str(tmp_path / "o.jsonl"))
    assert p.returncode == 2 and p.stderr.strip() == "localspec: error: --output needs --input"
    p = run_cli("--input", str(tmp_path / "missing.jsonl"))
    assert p.returncode == 2 and "does not exist" in p.stderr and "Traceback" not in p.stderr
