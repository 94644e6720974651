"""server/tools.py without a model: response_format and tool validation, the tool-call grammar (checked
with llguidance against byte strings), rendering tool messages, parsing and streaming calls."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from localspec.constraints import Constraint
from localspec.server.schemas import InvalidParam
from localspec.server.tools import (ToolCallStream, generic_messages, parse_tool_calls, plan_tools,
                                    response_format_constraint, template_messages, tool_grammar)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}},
]


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A vocabulary of the 256 bytes and an EOS: any text is a sequence of tokens."""
    class Bytes:
        eos_token_id = 256
        bos_token_id = None
        special_token_ids = [256]
        tokens = [bytes([b]) for b in range(256)] + [b"\xff</s>"]

        def __call__(self, text):
            return list(text.encode() if isinstance(text, str) else text)

    return LLTokenizer(TokenizerWrapper(Bytes()), n_vocab=257, eos_token=256)


def accepts(tokenizer, constraint, text: str) -> bool:
    m = LLMatcher(tokenizer, constraint.grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    data = list(text.encode())
    return m.try_consume_tokens(data) == len(data) and m.is_accepting()


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'


def test_required_allows_only_well_formed_calls(byte_tokenizer):
    g = tool_grammar(plan_tools(TOOLS, "required", None, None))
    assert accepts(byte_tokenizer, g, CALL)
    assert accepts(byte_tokenizer, g, CALL + "\n" + CALL2)
    assert not accepts(byte_tokenizer, g, CALL + "\n" + CALL2 + "\n" + CALL)  # at most one call per tool
    assert not accepts(byte_tokenizer, g, "Hello")
    assert not accepts(byte_tokenizer, g, CALL.replace("get_weather", "get_stock"))
    assert not accepts(byte_tokenizer, g, CALL.replace('"city"', '"town"'))  # a required argument missing
    assert not accepts(byte_tokenizer, g, CALL.replace('"Paris"}', '"Paris", "extra": 1}'))  # keys it does not name


def test_named_auto_and_single_call(byte_tokenizer):
    named = tool_grammar(plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, None))
    assert accepts(byte_tokenizer, named, CALL2) and not accepts(byte_tokenizer, named, CALL)
    auto = tool_grammar(plan_tools(TOOLS, "auto", None, None))
    assert accepts(byte_tokenizer, auto, CALL) and accepts(byte_tokenizer, auto, "It is sunny.")
    assert not accepts(byte_tokenizer, auto, "<tool_call>\nnot json")
    single = tool_grammar(plan_tools(TOOLS, "required", False, None))
    assert accepts(byte_tokenizer, single, CALL) and not accepts(byte_tokenizer, single, CALL + "\n" + CALL2)
    json_text = tool_grammar(plan_tools(TOOLS, "auto", None, response_format_constraint({"type": "json_object"})))
    assert accepts(byte_tokenizer, json_text, '{"a": 1}') and not accepts(byte_tokenizer, json_text, "plain")


@pytest.mark.parametrize("tools, choice, param", [
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([{"type": "function", "function": {"name": "bad name"}}], "auto", "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}], "auto",
     "tools[0].function.parameters"),
    (TOOLS + TOOLS[:1], "auto", "tools[2].function.name"),
])
def test_bad_tools_name_the_field(tools, choice, param):
    with pytest.raises(InvalidParam) as e:
        plan_tools(tools, choice, None, None)
    assert e.value.param == param and e.value.code == "invalid_value"


def test_response_format():
    assert response_format_constraint(None) is None and response_format_constraint({"type": "text"}) is None
    assert response_format_constraint({"type": "json_object"}).kind == "json_schema"
    with pytest.raises(InvalidParam, match="name"):
        response_format_constraint({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}})
    # llama-server's shapes: a json_schema without a name, a schema beside the type
    assert response_format_constraint({"type": "json_schema", "json_schema": {"schema": {}}}).kind == "json_schema"
    limited = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for shape in ({"type": "json_object", "schema": limited}, {"type": "json_schema", "schema": limited}):
        assert response_format_constraint(shape) == Constraint.json_schema(limited)
    with pytest.raises(InvalidParam) as e:
        response_format_constraint({"type": "json_object", "schema": {"type": 3}})
    assert e.value.param == "response_format.schema"
    with pytest.raises(InvalidParam) as e:
        response_format_constraint({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}})
    assert e.value.param == "response_format.json_schema.schema"
    assert plan_tools(TOOLS, "none", None, None) is None and plan_tools(None, "auto", None, None) is None


def test_parse_and_stream_calls():
    calls = parse_tool_calls(CALL + "\n" + CALL2)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "UTC"})]
    assert calls[0]["id"] != calls[1]["id"] and parse_tool_calls("Hello") is None
    stream = ToolCallStream()
    text = CALL + "\n" + CALL2
    sent = []
    for i in range(0, len(text), 7):
        content, deltas = stream.feed(text[i:i + 7])
        assert content == ""
        sent += deltas
    assert [(d["index"], d["function"]["name"]) for d in sent] == [(0, "get_weather"), (1, "get_time")]
    plain = ToolCallStream()
    assert plain.feed("Hi") == ("Hi", []) and plain.feed(" there") == (" there", [])
    assert stream.unsent() == "" and plain.unsent() == ""  # everything went out as calls / content


def test_a_stream_cut_inside_a_call_keeps_its_text():
    cut = ToolCallStream()
    assert cut.feed(CALL[:20]) == ("", [])
    assert cut.unsent() == CALL[:20]  # no call completed: all of it
    after_one = ToolCallStream()
    after_one.feed(CALL + "\n" + CALL2[:15])
    assert after_one.sent == 1 and after_one.unsent() == "\n" + CALL2[:15]  # what followed the call sent


def test_tool_messages_render_for_templates_with_and_without_tools():
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}]
    generic = generic_messages(history, plan_tools(TOOLS, "auto", None, None))
    assert generic[0]["role"] == "system" and "Be brief." in generic[0]["content"] and "<tools>" in generic[0]["content"]
    assert generic[2] == {"role": "assistant", "content": CALL}
    assert generic[3] == {"role": "user", "content": '<tool_response>\n{"sky": "clear"}\n</tool_response>'}
    native = template_messages(history)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[3]["role"] == "tool"


def test_a_template_that_takes_tools_gets_them_and_the_calls():
    from localspec.runtime import chat
    from localspec.server.tools import template_takes_tools

    template = ("{% if tools %}TOOLS {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
                "{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}\n{% endfor %}")
    assert template_takes_tools(template) and not template_takes_tools(chat.CHATML_TEMPLATE)
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "clear"}]
    text = chat.render(template, template_messages(history), tools=TOOLS, add_generation_prompt=False)
    # (templates render with trim_blocks: the newline after a block tag goes)
    assert text == 'TOOLS get_weather get_time user: Weather?assistant: CALL get_weather {"city": "P"}tool: clear (call_1)'
