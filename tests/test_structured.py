"""Structured output and tool calls on the real default pair: the `openai` client's parse() against
`localspec serve`, schema-valid sampled output, greedy output the same with the draft, prompt lookup
and the oracle alone, tool calls (plain, streamed, and a follow-up with the tool's result), and the
errors (400 / exit 2) for bad schemas, grammars and tool choices. The model is tiny: the tests check
structure, never the quality of what it says."""

from __future__ import annotations

import json
import subprocess
from typing import Annotated

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from localspec.constraints import Constraint, ConstraintError, ConstraintWalk
from localspec.options import GenerationOptions
from serving import CLI, cli_serve, wait_ready

pytestmark = pytest.mark.model


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)
    city: str = Field(max_length=24)
    languages: list[Annotated[str, Field(max_length=24)]] = Field(max_length=3)  # every string bounded: a
    # sampled (unseeded) answer must end within max_tokens (an unbounded language once ran past 200)


PERSON_PROMPT = [{"role": "user", "content": "Invent a person: name, age, city and the languages they speak."}]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The current time in a timezone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                       "required": ["timezone"]}}},
]
WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def served(pair_paths):
    """`localspec serve` on the default pair (drafting on; the oracle alone per request)."""
    with cli_serve("--ctx", "2048", "--draft-length", "6") as handle:
        yield handle


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=wait_ready(served) + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.mark.parametrize("speculative", [True, False], ids=["draft", "no-draft"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 7}, {"temperature": 0.8}],
                         ids=["greedy", "seeded", "sampled"])
def test_openai_parse_returns_the_pydantic_object(client, speculative, sampling):
    r = client.chat.completions.parse(model="smollm2", messages=PERSON_PROMPT, response_format=Person,
                                      max_tokens=400, extra_body={"speculative": {"enabled": speculative}},
                                      **sampling)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    if speculative:
        assert r.usage.drafted > 0 and r.usage.accepted > 0  # acceptance under the constraint shows in usage
    else:
        assert r.usage.drafted == 0


class City(BaseModel):
    name: str
    country: str
    population: int


@pytest.mark.parametrize("question", ["Describe Paris as JSON.", "Describe Tokyo as JSON.",
                                      "Give me a JSON object about London."])
def test_parse_of_strings_and_an_integer_returns_the_object(client, question):
    """Greedy, the model writes `"population": 1111...`: the integer ends after 16 digits (it once
    ran to max_tokens and parse() raised LengthFinishReasonError)."""
    r = client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": question}],
                                      response_format=City, max_tokens=200, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, City)


def test_numbers_and_open_values_are_bounded(engine):
    model = engine.oracle_model
    tokens = lambda text: model.tokenize(text, add_special=False, parse_special=False)  # noqa: E731

    def longest(constraint: Constraint, text: str) -> str:
        walk = ConstraintWalk.of(engine.oracle_model, constraint)
        pushed = tokens(text)[:walk.extend(tokens(text))]
        return model.detokenize(pushed)

    city = Constraint.json_schema(City)
    start = '{"name": "Paris", "country": "France", "population": '
    assert longest(city, start + "1" * 30 + "}") == start + "1" * 16  # 16 digits, then only the end of it
    assert longest(city, start + '5, "mayor": "x"}') == start + "5"  # the object names its properties
    json_mode = Constraint.json_object()
    assert longest(json_mode, '{"a": [0.' + "3" * 30) == '{"a": [0.' + "3" * 10
    assert longest(json_mode, '{"b": -' + "7" * 30) == '{"b": -' + "7" * 16


def test_json_object_and_metrics(client, served):
    url = wait_ready(served)
    before = _metric(url, "localspec_tokens_accepted_total")
    question = [{"role": "user", "content": 'Reply with a JSON object with the keys "city" and "country" for Paris.'}]
    r = client.chat.completions.create(model="smollm2", messages=question, max_tokens=120, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert _metric(url, "localspec_tokens_accepted_total") - before == r.usage.accepted > 0


def test_max_tokens_inside_the_json_is_length(client):
    r = client.chat.completions.create(model="smollm2", messages=PERSON_PROMPT, max_tokens=8, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "person", "schema": Person.model_json_schema()}})
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model="smollm2", messages=PERSON_PROMPT, response_format=Person,
                                      max_tokens=8, temperature=0)


# ---------------------------------------------------------------- in process: exactness and validity


def test_sampled_outputs_follow_the_schema(engine):
    finished = 0
    for seed in range(10):
        r = engine.generate(PERSON_PROMPT, max_tokens=200, temperature=1.0, seed=seed, schema=Person)
        if r.finish_reason == "length":  # a long string can run past max_tokens; then it says so
            assert r.structure == "incomplete"
            continue
        assert r.structure == "complete"
        Person.model_validate_json(r.text)
        finished += 1
    r = engine.generate(PERSON_PROMPT, max_tokens=200, temperature=1.0, schema=Person)  # unseeded
    assert r.finish_reason == "length" or Person.model_validate_json(r.text)
    assert finished >= 8


def test_a_rejected_end_leaves_the_length_limits_in_force(engine):
    """A draft of `"}` and the end, rejected, rolls back: the string's maxLength still counts what
    came before (llguidance 1.9.1 rolled back over a consumed EOS lost count; a sampled answer once
    ran a 24-character string to 31)."""
    model = engine.oracle_model
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}, "required": ["a"],
              "additionalProperties": False}
    tokens = lambda text: model.tokenize(text, add_special=False, parse_special=False)  # noqa: E731
    walk = ConstraintWalk.of(engine.oracle_model, Constraint.json_schema(schema))
    walk.extend(tokens('{"a": "ab'))
    end = tokens('"}') + [model.eos]
    assert walk.extend(end) == len(end) and walk.complete
    walk.pop(len(end))
    assert not walk.complete
    pushed = [walk.extend([t]) for t in tokens("cdefgh")]  # "c", "def", "gh": "abcdef" would be too long
    assert pushed == [1, 0, 1]


def test_greedy_constrained_output_is_the_same_with_any_drafting(engine, pair_paths):
    from localspec.runtime.engine import Engine

    oracle, _ = pair_paths
    with Engine(oracle, "ngram", n_ctx=2048, draft_length=6) as lookup:
        for prompt in (PERSON_PROMPT, [{"role": "user", "content": "Describe Paris as JSON."}]):
            draft = engine.generate(prompt, max_tokens=120, schema=Person)
            alone = engine.generate(prompt, max_tokens=120, schema=Person, speculative=False)
            looked = lookup.generate(prompt, max_tokens=120, schema=Person)
            assert draft.text == alone.text == looked.text
            assert draft.stats.accepted > 0 and alone.stats.drafted == 0
            Person.model_validate_json(draft.text)
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    outs = {engine.generate(WEATHER, max_tokens=20, grammar=gbnf, speculative=s).text for s in (True, False)}
    assert len(outs) == 1 and outs.pop() in ("The answer is yes.", "The answer is no.")


def test_invalid_schema_raises_before_generating(engine):
    with pytest.raises(ConstraintError, match="Invalid type"):
        engine.stream(PERSON_PROMPT, schema={"type": "nope"})
    with pytest.raises(ConstraintError, match="grammar"):
        engine.stream(PERSON_PROMPT, grammar="root ::= (")


# ---------------------------------------------------------------- tool calls


def _check_calls(calls) -> None:
    assert calls
    names = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        assert set(names[call.function.name]["required"]) <= set(args) <= set(names[call.function.name]["properties"])
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_required_tool_choice_yields_well_formed_calls(client, temperature):
    r = client.chat.completions.create(model="smollm2", messages=WEATHER, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, temperature=temperature, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls)


def test_named_tool_choice_calls_that_function(client):
    r = client.chat.completions.create(model="smollm2", messages=WEATHER, tools=TOOLS, max_tokens=200, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = r.choices[0].message.tool_calls
    _check_calls(calls)
    assert [c.function.name for c in calls] == ["get_time"]


def test_streamed_tool_calls_reassemble_to_the_same_calls_and_a_follow_up_is_accepted(client):
    options = dict(model="smollm2", messages=WEATHER, tools=TOOLS, tool_choice="required", max_tokens=200,
                   temperature=0)
    whole = client.chat.completions.create(**options).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**options, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        for d in delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += d.id or ""
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]

    call = whole[0]
    history = WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "cloudy"})}]
    r = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.finish_reason == "tool_calls":
        _check_calls(choice.message.tool_calls)
    else:
        assert choice.message.content and not choice.message.content.startswith("<")


def test_a_reply_cut_inside_a_tool_call_gives_its_text_both_ways(client):
    options = dict(model="smollm2", messages=WEATHER, tools=TOOLS, tool_choice="required", max_tokens=12,
                   temperature=0)
    whole = client.chat.completions.create(**options).choices[0]
    assert whole.finish_reason == "length" and not whole.message.tool_calls
    assert whole.message.content.startswith("<tool_call>")
    content, finish, calls = "", None, []
    for chunk in client.chat.completions.create(**options, stream=True):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            calls += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert (content, finish, calls) == (whole.message.content, "length", [])


def test_auto_tool_choice_gives_text_or_calls(client):
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hello."}],
                                       tools=TOOLS, max_tokens=40, temperature=0)
    choice = r.choices[0]
    if choice.message.tool_calls:
        _check_calls(choice.message.tool_calls)
    else:
        assert choice.message.content and not choice.message.content.startswith("<")


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("change, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"$ref": "#/missing"}}}},
     "response_format.json_schema.schema"),
    ({"grammar": 'root ::= ( "yes"'}, "grammar"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
])
def test_bad_schema_grammar_or_tool_choice_is_a_400(served, change, param):
    r = httpx.post(wait_ready(served) + "/v1/chat/completions", timeout=30,
                   json={"model": "smollm2", "messages": WEATHER, "max_tokens": 4, **change})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"].startswith(param)


def test_cli_bad_schema_and_grammar_exit_2(tmp_path):
    bad_schema = tmp_path / "s.json"
    bad_schema.write_text('{"type": "nope"}')
    bad_grammar = tmp_path / "g.gbnf"
    bad_grammar.write_text('root ::= ( "yes"')
    for option, path, words in (("--json-schema", bad_schema, "Invalid type"), ("--grammar", bad_grammar, "GBNF")):
        p = subprocess.run(CLI + ["generate", "hi", option, str(path)], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and words in p.stderr, p.stderr


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return 0.0


def test_batch_lines_carry_their_schema_or_grammar(engine, tmp_path):
    from contextlib import nullcontext

    from localspec.cli.jobs import run_batch

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"id": "person", "messages": PERSON_PROMPT, "json_schema": Person.model_json_schema()},
             {"id": "yes-no", "prompt": "Is the sky blue?", "grammar": 'root ::= "yes" | "no"'},
             {"id": "short", "messages": PERSON_PROMPT, "json_schema": Person.model_json_schema(), "max_tokens": 5},
             {"id": "bad", "prompt": "x", "json_schema": {"type": "nope"}},
             {"id": "both", "prompt": "x", "json_schema": {}, "grammar": "start: /a/"}]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run_batch(str(inp), str(out), open_engine=lambda: nullcontext(engine), progress=lambda _: None,
              defaults=GenerationOptions(max_tokens=200))
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    Person.model_validate_json(got["person"]["text"])
    assert got["person"]["structure"] == "complete" and got["person"]["finish_reason"] == "stop"
    assert got["yes-no"]["text"] in ("yes", "no")
    assert (got["short"]["finish_reason"], got["short"]["structure"]) == ("length", "incomplete")
    assert "Invalid type" in got["bad"]["error"] and "not both" in got["both"]["error"]
