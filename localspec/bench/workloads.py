"""Workloads: the bundled prompt sets (``workloads/*.jsonl``), one JSON object per line:

    {"id": "chat-01", "messages": [{"role": "user", "content": "..."}], "max_tokens": 128}
    {"id": "raw-01", "prompt": "Once upon a time", "max_tokens": 64}

``messages`` go through the oracle's chat template; ``prompt`` is sent as is (a completion prompt).

- chat:     open-ended answers (the draft has to guess)
- grounded: rewrite / summarise / extract from a passage in the prompt (the answer copies from it)
- code:     edit a given function (the answer repeats most of it)
- long:     400+ tokens of output
- copy:     repeat a passage, a list or code given in the prompt (prompt lookup's best case)
- records:  product listings turned into six-field records under one system prompt and example
            (not in the default set: `localspec bench --clients --workload records` runs them twice on a server)
- structured: JSON answers under a JSON schema (a record's optional "json_schema"; localspec's systems
            constrain the output to it, the C++ anchor and llama-cpp-python's lookup do not)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

WORKLOAD_DIR = Path(__file__).with_name("workloads")
WORKLOADS = ("chat", "grounded", "code", "long", "copy")


@dataclass(frozen=True)
class BenchPrompt:
    workload: str
    id: str
    max_tokens: int
    messages: tuple[dict[str, str], ...] | None = None
    prompt: str | None = None
    json_schema: str | None = None  # JSON text of the schema the output must follow (structured workloads)

    @property
    def request(self) -> Any:
        """What Engine.tokenize_prompt takes: the chat messages or the raw prompt."""
        return [dict(m) for m in self.messages] if self.messages is not None else self.prompt

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"workload": self.workload, "id": self.id, "max_tokens": self.max_tokens}
        if self.messages is not None:
            d["messages"] = [dict(m) for m in self.messages]
        else:
            d["prompt"] = self.prompt
        if self.json_schema is not None:
            d["json_schema"] = json.loads(self.json_schema)
        return d


def parse_record(workload: str, record: dict, where: str = "") -> BenchPrompt:
    where = where or workload
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object")
    pid = record.get("id")
    if not isinstance(pid, str) or not pid:
        raise ValueError(f"{where}: every record needs a string id")
    max_tokens = record.get("max_tokens")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{where}: {pid}: max_tokens must be a positive integer")
    schema = record.get("json_schema")
    if schema is not None and not isinstance(schema, dict):
        raise ValueError(f"{where}: {pid}: json_schema must be a JSON object")
    schema_text = json.dumps(schema) if schema is not None else None
    messages, prompt = record.get("messages"), record.get("prompt")
    if (messages is None) == (prompt is None):
        raise ValueError(f"{where}: {pid}: give exactly one of messages or prompt")
    if messages is not None:
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                           for m in messages)):
            raise ValueError(f"{where}: {pid}: messages must be a list of {{role, content}} objects")
        return BenchPrompt(workload, pid, max_tokens, messages=tuple({"role": m["role"], "content": m["content"]}
                                                                     for m in messages), json_schema=schema_text)
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: {pid}: prompt must be a non-empty string")
    return BenchPrompt(workload, pid, max_tokens, prompt=prompt, json_schema=schema_text)


def load_file(path: Path | str, workload: str | None = None) -> list[BenchPrompt]:
    path = Path(path)
    workload = workload or path.stem
    prompts, seen = [], set()
    for n, line in enumerate(path.read_text("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: invalid JSON: {e}") from None
        p = parse_record(workload, record, f"{path}:{n}")
        if p.id in seen:
            raise ValueError(f"{path}:{n}: duplicate id {p.id}")
        seen.add(p.id)
        prompts.append(p)
    return prompts


def available() -> list[str]:
    return sorted(p.stem for p in WORKLOAD_DIR.glob("*.jsonl"))


def load(names: Iterable[str] | None = None, *, max_prompts: int | None = None,
         max_tokens: int | None = None) -> list[BenchPrompt]:
    """The named workloads (bundled names or paths to .jsonl files), at most max_prompts from each,
    each prompt's max_tokens capped at max_tokens."""
    out: list[BenchPrompt] = []
    for name in (list(names) if names else list(WORKLOADS)):
        path = Path(name)
        if not (name.endswith(".jsonl") and path.is_file()):
            path = WORKLOAD_DIR / f"{name}.jsonl"
            if not path.is_file():
                raise ValueError(f"unknown workload {name!r} (bundled: {', '.join(available())}; or a path to a .jsonl file)")
        prompts = load_file(path)
        prompts = prompts[:max_prompts] if max_prompts else prompts
        if max_tokens:
            prompts = [dataclasses.replace(p, max_tokens=min(p.max_tokens, max_tokens)) for p in prompts]
        out.extend(prompts)
    return out
