"""Chat-template rendering from the GGUF's `tokenizer.chat_template` (Jinja2, as HF transformers
renders it), with a ChatML fallback for models that ship no template."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger("localspec.runtime.chat")

ROLES = ("system", "user", "assistant", "tool", "developer")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """Messages that cannot be rendered (bad roles, or the template refused them)."""


class _IgnoreGenerationTags(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise(message: str):
    raise ChatTemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_IgnoreGenerationTags, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")  # passed on to templates that use them


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ChatTemplateError(f"messages[{i}]: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}]: content must be a string")
        message = {"role": "system" if role == "developer" else role, "content": content}
        message.update((k, m[k]) for k in TOOL_FIELDS if m.get(k) is not None)
        out.append(message)
    return out


def render(template: str | None, messages: Sequence[Mapping[str, Any]], *, bos_token: str = "",
           eos_token: str = "", add_generation_prompt: bool = True, tools: list | None = None) -> str:
    """Render `messages` with the model's template (ChatML when it has none); `tools` (OpenAI's
    function specs) for a template that takes them."""
    msgs = validate_messages(messages)
    if not template:
        template = CHATML_TEMPLATE
    try:
        return _compile(template).render(
            messages=msgs, bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt, **({"tools": tools} if tools else {}))
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the model's chat template failed: {e}") from e
