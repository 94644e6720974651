"""`localspec generate --input requests.jsonl --output results.jsonl`: scripted batch generation.

Input, one JSON object per line:
    {"id": ..., "prompt": "..." | "messages": [...], "raw": false,
     "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
     "json_schema": {...} | "grammar": "..."}   (all optional but id)
A "prompt" is sent as a chat user message (after --system, if given) unless "raw" is true (or the
--raw flag is given and the line does not say otherwise); sampling fields override the command line.

Output, one JSON object per line, in the order the records finish (up to `--parallel` generate at
once, in one batch; a malformed line's record comes as it is reached):
    {"id", "text", "finish_reason", "stats"}   or   {"id", "error"}
(with "structure": "complete" | "incomplete" under a schema or grammar). A line's "json_schema" /
"grammar" replaces --json-schema / --grammar; an invalid one is that line's error.

The input is UTF-8 (a leading byte-order mark is accepted); a line that is not valid UTF-8 becomes
an error record naming the line, like any other malformed line. Lines end at LF or CRLF only.

Resumable: ids already in the output file are skipped. Each record is one whole line written with a
single write + fsync, so an interrupted run loses at most the records in flight; a truncated last
line (a crash mid-write) is cut off before appending.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import click

from localspec.options import OPTIONS, GenerationOptions, OptionError

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop")
STRUCTURE_FIELDS = {"json_schema": "schema", "grammar": "grammar"}  # a line's field -> the option
FIELDS = frozenset(("id", "prompt", "messages", "raw") + SAMPLING_FIELDS + tuple(STRUCTURE_FIELDS))


class BadRequest(ValueError):
    def __init__(self, record_id: Any, message: str) -> None:
        super().__init__(message)
        self.record_id = record_id


@dataclass
class Item:
    """One input line: a request to run, or the error to record for it."""

    lineno: int
    id: Any
    prompt: Any = None  # str (raw completion) or chat messages
    options: GenerationOptions | None = None  # the command line's, with the line's fields
    error: str | None = None

    @property
    def key(self) -> str:
        return id_key(self.id)


def id_key(record_id: Any) -> str:
    """Ids compare as JSON values: 1 and "1" are different ids."""
    return json.dumps(record_id, sort_keys=True, ensure_ascii=False)


def parse_line(line: str, lineno: int, *, defaults: GenerationOptions, system: str | None, raw: bool) -> Item:
    """One input line -> an Item: its prompt, and `defaults` (the command line's options) with the
    line's fields, checked (`error` set when the line is malformed, or a value breaks its option's
    rule: the rules of localspec.options, in the words the command line uses)."""
    fallback_id = f"line-{lineno}"
    if isinstance(line, NotUTF8):
        return Item(lineno, fallback_id, error=str(line))
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return Item(lineno, fallback_id, error=f"line {lineno}: not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return Item(lineno, fallback_id, error=f"line {lineno}: expected a JSON object")
    record_id = obj.get("id")
    if record_id is None or isinstance(record_id, bool) or not isinstance(record_id, (str, int)):
        return Item(lineno, fallback_id,
                    error=f"line {lineno}: \"id\" must be a string or an integer" if "id" in obj
                    else f"line {lineno}: missing \"id\"")
    try:
        prompt, options = _request(obj, defaults=defaults, system=system, raw=raw)
    except BadRequest as e:
        return Item(lineno, record_id, error=str(e))
    return Item(lineno, record_id, prompt=prompt, options=options)


def _request(obj: dict[str, Any], *, defaults: GenerationOptions, system: str | None,
             raw: bool) -> tuple[Any, GenerationOptions]:
    rid = obj["id"]
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise BadRequest(rid, f"unknown field {unknown[0]!r} (expected: {', '.join(sorted(FIELDS))})")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise BadRequest(rid, "give exactly one of \"prompt\" and \"messages\"")
    line_raw = obj.get("raw")
    if line_raw is not None and not isinstance(line_raw, bool):
        raise BadRequest(rid, "\"raw\" must be true or false")
    if has_prompt:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise BadRequest(rid, "\"prompt\" must be a non-empty string")
        if (raw if line_raw is None else line_raw):
            request: Any = prompt
        else:
            request = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    else:
        if line_raw:
            raise BadRequest(rid, "\"raw\" applies to \"prompt\", not to \"messages\"")
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest(rid, "\"messages\" must be a non-empty list of objects")
        request = messages
    changes = {name: obj[name] for name in SAMPLING_FIELDS if name in obj}
    given = [name for name in STRUCTURE_FIELDS if name in obj]
    if len(given) > 1:
        raise BadRequest(rid, "give \"json_schema\" or \"grammar\", not both")
    if given:  # the line's schema or grammar replaces the command line's
        option = OPTIONS[STRUCTURE_FIELDS[given[0]]]
        if obj[given[0]] is None:
            raise BadRequest(rid, f"{option.rule}, got null")
        changes |= {"schema": None, "grammar": None, option.name: obj[given[0]]}
    try:
        return request, GenerationOptions.build(defaults, **changes)  # the rules; a schema or grammar compiles
    except OptionError as e:
        raise BadRequest(rid, e.in_json()) from None
    except ValueError as e:  # constraints.ConstraintError
        raise BadRequest(rid, str(e)) from None


# ---------------------------------------------------------------- output


def read_done(path: str, warn: Callable[[str], None]) -> dict[str, str | None]:
    """The ids already in the output file, each with its record's text (None: an error record). A truncated
    last line (no newline: a crash mid-write) is cut off so appending starts on a fresh line;
    unreadable complete lines are ignored."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return {}
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        warn(f"{path}: dropped a truncated last line ({len(data) - keep} bytes) from an interrupted run")
        data = data[:keep]
    done: dict[str, str | None] = {}
    bad = 0
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            done[id_key(record["id"])] = None if "error" in record else str(record.get("text", ""))
        except (ValueError, KeyError, TypeError):
            bad += 1
    if bad:
        warn(f"{path}: ignored {bad} unreadable line{'s' if bad > 1 else ''}")
    return done


class RecordWriter:
    """Appends one JSON record per line: one write, flush and fsync each (a file), or to stdout."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.fd = None if path is None else os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        if self.fd is None:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
            return
        view = memoryview(data)
        while view:  # a regular file takes it in one write; loop for the pathological case
            n = os.write(self.fd, view)
            view = view[n:]
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# ---------------------------------------------------------------- the run


@dataclass
class Summary:
    written: int = 0
    failed: int = 0
    skipped: int = 0
    skipped_errors: int = 0  # of the skipped, ids whose record in the output is an error
    duplicates: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Every id of the input has a successful record in the output (exit status 0)."""
        return self.failed == 0 and self.skipped_errors == 0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def line(self) -> str:
        acc = f"acceptance {self.acceptance:.0%}" if self.acceptance is not None else "acceptance n/a"
        tps = self.tokens / self.seconds if self.seconds > 0 else 0.0
        text = (f"{self.written} records written ({self.failed} failed)")
        if self.skipped:
            text += f", {self.skipped} skipped (already in the output"
            text += f", {self.skipped_errors} of them errors)" if self.skipped_errors else ")"
        if self.duplicates:
            text += f", {self.duplicates} repeated id{'s' if self.duplicates > 1 else ''} skipped"
        return text + f"; {self.tokens} tokens in {self.seconds:.1f} s ({tps:.1f} tok/s), {acc}"


class NotUTF8(str):
    """An input line that is not valid UTF-8: its error message (parse_line turns it into an error item)."""


def read_lines(path: str) -> list[tuple[int, str]]:
    """Non-blank input lines with their 1-based line numbers ('-': stdin), decoded as UTF-8 one
    line at a time: a line that is not UTF-8 comes back as a NotUTF8 message. A leading BOM is
    dropped. Only LF and CRLF end a line (a JSON string may hold U+2028 and friends)."""
    if path == "-":
        data = sys.stdin.buffer.read()
    else:
        with open(path, "rb") as f:
            data = f.read()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    out: list[tuple[int, str]] = []
    for i, raw in enumerate(data.split(b"\n"), 1):
        raw = raw.removesuffix(b"\r")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = NotUTF8(f"line {i}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)")
        if line.strip():
            out.append((i, line))
    return out


def run_batch(input_path: str, output_path: str | None, *, open_engine: Callable[[], Any],
              defaults: GenerationOptions, system: str | None = None, raw: bool = False,
              progress: Callable[[str], None], show_bar: bool | None = None) -> Summary:
    """Run every request in `input_path` not already in `output_path` (None or '-': stdout), each
    with `defaults` (the command line's options) changed by its line's fields."""
    if output_path == "-":
        output_path = None
    items = [parse_line(line, n, defaults=defaults, system=system, raw=raw) for n, line in read_lines(input_path)]
    done = read_done(output_path, progress) if output_path else {}
    summary = Summary()
    pending: list[Item] = []
    queued: set[str] = set()
    for item in items:
        if item.key in done:
            summary.skipped += 1
            summary.skipped_errors += done[item.key] is None
        elif item.key in queued:
            summary.duplicates += 1
        else:
            queued.add(item.key)
            pending.append(item)
    if not pending:
        if not items:
            progress("no requests in the input")
        else:
            errors = f" ({summary.skipped_errors} of them error records: delete those lines to retry them)" \
                if summary.skipped_errors else ""
            progress(f"nothing to do: every id in the input is already in {output_path}{errors}")
        return summary

    needs_engine = any(item.error is None for item in pending)
    with (open_engine() if needs_engine else nullcontext()) as engine:  # load failures leave no output file
        warmed = _warm_suffix_cache(engine, items, done)
        if warmed:
            progress(f"the suffix cache starts from the {warmed} answers already in {output_path}")
        writer = RecordWriter(output_path)
        t_start = time.perf_counter()
        try:
            for record in _with_bar(_records(engine, pending, summary), len(pending), summary, show_bar):
                writer.write(record)
        except KeyboardInterrupt:
            summary.seconds = time.perf_counter() - t_start
            progress(f"interrupted: {summary.line()}")
            progress("run the same command again to resume")
            raise
        finally:
            writer.close()
        summary.seconds = time.perf_counter() - t_start
    progress(summary.line())
    return summary


def _warm_suffix_cache(engine, items: list[Item], done: dict[str, str | None]) -> int:
    """Hand the engine's suffix cache the prompts and answers a resumed run already wrote, as if
    this process had generated them; the number handed."""
    if engine is None or engine.suffix is None:
        return 0
    answered = [(item, done[item.key]) for item in items if item.error is None and done.get(item.key) is not None]
    for item, text in answered:
        engine.remember(item.prompt, text)
    return len(answered)


def _records(engine, items: list[Item], summary: Summary) -> Iterator[dict[str, Any]]:
    """Each item's record as it finishes: up to the engine's slots generate at once, in one batch
    (a malformed line's error record comes as it is reached). Stopped early (Ctrl-C), the records
    in flight are dropped, not written: a rerun generates them."""
    from localspec.runtime.sequence import Status

    pending = deque(items)
    in_flight: dict[Any, Item] = {}
    try:
        while pending or in_flight:
            while pending and len(in_flight) < (engine.n_slots if engine is not None else 1):
                item = pending.popleft()
                if item.error is None:
                    try:
                        seq = engine.prepare(item.prompt, item.options)
                    except ValueError as e:  # prompt too long, template errors, a token outside the vocabulary
                        item.error = str(e)
                    else:
                        in_flight[engine.scheduler.add(seq)] = item
                        continue
                yield _error_record(item, summary)
            if not in_flight:
                continue
            engine.scheduler.step()
            for seq in [s for s in in_flight if s.done]:
                item = in_flight.pop(seq)
                if seq.status == Status.FINISHED:
                    yield _result_record(item, seq, summary)
                else:  # its pass failed
                    item.error = f"generation failed: {seq.error}"
                    yield _error_record(item, summary)
    finally:
        for seq in in_flight:
            engine.scheduler.abort(seq)


def _result_record(item: Item, seq, summary: Summary) -> dict[str, Any]:
    s = seq.stats
    seq.outbox.clear()  # the text is whole in the stream
    summary.written += 1
    summary.tokens += s.completion_tokens
    summary.drafted += s.drafted
    summary.accepted += s.accepted
    record = {"id": item.id, "text": seq.text.text, "finish_reason": seq.finish_reason, "stats": s.to_dict()}
    if seq.structure is not None:
        record["structure"] = seq.structure
    return record


def _error_record(item: Item, summary: Summary) -> dict[str, Any]:
    summary.written += 1
    summary.failed += 1
    return {"id": item.id, "error": item.error}


def _with_bar(records: Iterator[dict[str, Any]], total: int, summary: Summary,
              show_bar: bool | None) -> Iterator[dict[str, Any]]:
    """A progress bar on stderr (ETA, running acceptance) when stderr is a terminal."""
    if show_bar is None:
        show_bar = sys.stderr.isatty()
    if not show_bar:
        yield from records
        return

    def status(_item: Any) -> str:
        acc = summary.acceptance
        return f"acceptance {acc:.0%}" if acc is not None else ""

    with click.progressbar(length=total, label="generating", file=sys.stderr, show_eta=True,
                           show_pos=True, item_show_func=status) as bar:
        for record in records:
            yield record
            bar.update(1, record)
