"""Structured output on the OpenAI API: `response_format` and `tools` / `tool_choice`.

Tool calls are written in the Hermes / Qwen2.5 form, one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The prompt describes the tools through the model's chat template when it takes `tools` (Qwen2.5's,
Hermes', ...), else through a generic system message (`tool_prompt`). The output is constrained by
a grammar (`tool_grammar`): with `tool_choice` "required" or a named function only well-formed calls
of the allowed functions (their arguments following each function's parameter schema) can be
generated; with "auto" either calls or a plain text answer (or the `response_format`'s JSON), which
then cannot start with "<". So the reply always parses: `parse_tool_calls` reads the calls back.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from localspec.constraints import JSON_OPTIONS, Constraint, ConstraintError, bounded_schema
from localspec.server.schemas import InvalidParam

def _invalid(message: str, param: str) -> InvalidParam:
    return InvalidParam(message, param, "invalid_value")


_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


# ---------------------------------------------------------------- response_format


def grammar_constraint(grammar: str | None) -> Constraint | None:
    """The `grammar` extension field."""
    if grammar is None:
        return None
    try:
        return Constraint.from_grammar(grammar)
    except ConstraintError as e:
        raise _invalid(f"grammar: {e}", "grammar") from None


def response_format_constraint(response_format: dict[str, Any] | None) -> Constraint | None:
    """{"type": "text"} (or none): None; {"type": "json_object"}: any JSON object;
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}: that schema.
    llama-server's shapes too (clients written for it): {"type": "json_object", "schema": {...}} and
    {"type": "json_schema", "schema": {...}} enforce that schema, and a json_schema may omit its name."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise _invalid(f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}",
                       "response_format.type")
    if "schema" in response_format:  # llama-server's: the schema beside the type
        return _schema_constraint(response_format["schema"], "response_format.schema")
    if kind == "json_object":
        return Constraint.json_object()
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise _invalid("response_format.json_schema: missing (an object with 'name' and 'schema')",
                       "response_format.json_schema")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not _NAME.match(name)):
        raise _invalid("response_format.json_schema.name: letters, digits, '_' and '-' (at most 64)",
                       "response_format.json_schema.name")
    return _schema_constraint(spec.get("schema", {"type": "object"}), "response_format.json_schema.schema")


def _schema_constraint(schema: Any, where: str) -> Constraint:
    try:
        return Constraint.json_schema(schema)
    except ConstraintError as e:
        raise _invalid(f"{where}: {e}", where) from None


# ---------------------------------------------------------------- tools


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]
    spec: dict[str, Any]  # as the client sent it, for the template


@dataclass(frozen=True)
class ToolPlan:
    """What a request with tools generates under: the tools it may call and how."""

    tools: tuple[Tool, ...]
    choice: str  # "auto" | "required" | "function"
    parallel: bool
    text: Constraint | None  # under "auto": the response_format the non-call answer follows


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               text: Constraint | None) -> ToolPlan | None:
    """Validate `tools` and `tool_choice`; None when no tool may be called (no tools, or "none")."""
    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise _invalid("tool_choice: expected 'none', 'auto', 'required' or a function", "tool_choice")
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise _invalid(f"tool_choice: expected 'none', 'auto', 'required' or a function, got {tool_choice!r}",
                           "tool_choice")
    parsed = _parse_tools(tools or [])
    if not parsed:
        if tool_choice not in (None, "none", "auto"):
            raise _invalid("tool_choice: needs tools", "tool_choice")
        return None
    if tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise _invalid("tool_choice: expected {\"type\": \"function\", \"function\": {\"name\": ...}}",
                               "tool_choice")
        chosen = [t for t in parsed if t.name == name]
        if not chosen:
            raise _invalid(f"tool_choice: no tool named {name!r} in tools "
                               f"({', '.join(t.name for t in parsed)})", "tool_choice")
        return ToolPlan(tuple(parsed), "function:" + name, parallel_tool_calls is not False, None)
    return ToolPlan(tuple(parsed), tool_choice or "auto", parallel_tool_calls is not False, text)


def _parse_tools(tools: list[dict[str, Any]]) -> list[Tool]:
    out, names = [], set()
    for i, spec in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(spec, dict) or spec.get("type") != "function" or not isinstance(spec.get("function"), dict):
            raise _invalid(f"{where}: expected {{\"type\": \"function\", \"function\": {{...}}}}", where)
        f = spec["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _invalid(f"{where}.function.name: required, letters, digits, '_' and '-' (at most 64)",
                               f"{where}.function.name")
        if name in names:
            raise _invalid(f"{where}.function.name: {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        parameters = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise _invalid(f"{where}.function.parameters: must be a JSON schema object", f"{where}.function.parameters")
        try:
            Constraint.json_schema(parameters)
        except ConstraintError as e:
            raise _invalid(f"{where}.function.parameters: {e}", f"{where}.function.parameters") from None
        description = f.get("description")
        out.append(Tool(name, description if isinstance(description, str) else None, parameters, spec))
    return out


def _call_schema(tools: tuple[Tool, ...]) -> dict[str, Any]:
    """Each call an object of the tool's name and its arguments, numbers and open values bounded and
    objects closed (`constraints.bounded_schema`): a small model fills open objects with made-up keys."""
    options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return {**bounded_schema({"anyOf": options}), "x-guidance": JSON_OPTIONS}


def tool_grammar(plan: ToolPlan) -> Constraint:
    """The grammar of the reply: calls (one, or with parallel calls up to one per tool: a named
    tool_choice means one call), or under "auto" also a plain answer that does not start with "<"
    (or the response_format's JSON)."""
    tools = plan.tools
    if plan.choice.startswith("function:"):
        tools = tuple(t for t in tools if t.name == plan.choice.split(":", 1)[1])
    call = f'"<tool_call>\\n" %json {json.dumps(_call_schema(tools))} "\\n</tool_call>"'
    # parallel calls: at most one per tool (a small model would repeat its call until max_tokens)
    most = len(tools) if plan.parallel else 1
    lines = ["calls: " + " | ".join(' "\\n" '.join(["call"] * n) for n in range(1, most + 1)), f"call: {call}"]
    if plan.choice == "auto":
        if plan.text is not None:
            lines.insert(0, f"start: calls | %json {json.dumps(_text_schema(plan.text))}")
        else:
            lines.insert(0, "start: calls | TEXT")
            lines.append(r"TEXT: /[^<][\s\S]*/")
    else:
        lines.insert(0, "start: calls")
    return Constraint.from_grammar("\n".join(lines) + "\n", "lark")


def _text_schema(text: Constraint) -> dict[str, Any]:
    """The JSON schema a response_format constraint was built from (llguidance's grammar JSON holds it)."""
    grammar = json.loads(text.grammar)
    return grammar["grammars"][0]["json_schema"]


def tool_prompt(plan: ToolPlan) -> str:
    """The generic tool instructions, for a chat template that does not take tools."""
    specs = "\n".join(json.dumps({"type": "function", "function": {
        k: v for k, v in (("name", t.name), ("description", t.description), ("parameters", t.parameters))
        if v is not None}}, ensure_ascii=False) for t in plan.tools)
    text = ("You can call functions (tools). They are described by JSON schemas within <tools></tools>:\n"
            f"<tools>\n{specs}\n</tools>\n"
            "To call a function, reply with a JSON object holding its name and arguments within "
            "<tool_call></tool_call> tags, one block per call:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>\n'
            "A function's result comes back in a <tool_response></tool_response> block.")
    if plan.choice == "required":
        text += "\nCall at least one function now."
    elif plan.choice.startswith("function:"):
        text += f"\nCall the function {plan.choice.split(':', 1)[1]} now."
    else:
        text += "\nCall a function when it helps; otherwise answer directly."
    return text


# ---------------------------------------------------------------- messages


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def arguments_text(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


def generic_messages(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """Messages for a template that knows no tools: the tool instructions in the system message,
    assistant tool calls written out as <tool_call> blocks, tool results as <tool_response> user turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [CALL_OPEN + json.dumps({"name": c["function"]["name"],
                                              "arguments": _loads(c["function"].get("arguments"))},
                                             ensure_ascii=False) + CALL_CLOSE for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block  # the results of one turn's calls in one message
            else:
                out.append({"role": "user", "content": block, "_tool": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool", None)
    if plan is not None:
        prompt = tool_prompt(plan)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that takes tools: tool call arguments as objects (HF templates
    serialise them), the rest as sent."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _loads(c["function"].get("arguments"))}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def _loads(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments if arguments is not None else {}


# ---------------------------------------------------------------- the reply


def parse_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """The calls in a reply made under `tool_grammar` (None: a plain answer), OpenAI's shape:
    [{"id", "type": "function", "function": {"name", "arguments": JSON text}}]."""
    if not text.startswith("<tool_call>"):
        return None
    calls = []
    for block in _CALL.findall(text):
        call = json.loads(block)
        calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}})
    return calls


class ToolCallStream:
    """Turns streamed text into OpenAI's delta.tool_calls: each call is sent once its block closes
    (id, name and arguments in one delta), plain text as content (under "auto", a reply that does
    not start with "<")."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0  # calls sent
        self.mode: str | None = None  # "calls" | "text", known from the first character

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to send, tool call deltas to send) after `piece`."""
        self.text += piece
        if self.mode is None and self.text:
            self.mode = "calls" if self.text.startswith("<") else "text"
        if self.mode == "text":
            return piece, []
        if self.mode is None:
            return "", []
        return "", self._closed_calls()

    def unsent(self) -> str:
        """The text no delta carried: under "calls", what follows the last call sent (all of it when
        none was). A reply cut by max_tokens inside a call ends with it as content, as the whole
        (non-streamed) response gives the text of a reply whose calls did not complete."""
        if self.mode != "calls":
            return ""
        ends = [m.end() for m in _CALL.finditer(self.text)][:self.sent]
        return self.text[ends[-1] if ends else 0:]

    def _closed_calls(self) -> list[dict[str, Any]]:
        deltas = []
        for i, block in enumerate(_CALL.findall(self.text)):
            if i < self.sent:
                continue
            call = json.loads(block)
            deltas.append({"index": i, "id": f"call_{secrets.token_hex(12)}", "type": "function",
                           "function": {"name": call["name"],
                                        "arguments": json.dumps(call["arguments"], ensure_ascii=False)}})
            self.sent = i + 1
        return deltas
