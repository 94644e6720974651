"""The one definition of the generation options (localspec.options): each rule's bounds, its help
reaching click, the same rule rejecting the same value with the same words on the command line,
in a batch line, in the chat's /set, in the server's requests and in the engine, and a request's
options checked once on their way to the engine. No models: the server runs over the real engine
on a scripted model (tests/serving.py)."""

from __future__ import annotations

import json
import math
from collections import Counter

import click
import pytest
from click.testing import CliRunner

from localspec.cli.jobs import SAMPLING_FIELDS, parse_line
from localspec.cli.commands import main
from localspec.runtime.engine import Request
from localspec.options import OPTIONS, GenerationOptions, Kind, Option, OptionError
from localspec.cli.repl import SETTABLE, SettingError, Settings, set_option
from localspec.speculative.sampling import SamplingParams

# (option, the last allowed values, the first rejected ones) at each bound
BOUNDS = [
    ("max_tokens", [1, 10**6], [0, -1]),
    ("temperature", [0, 0.0, 7.5], [-0.001, math.inf, math.nan]),
    ("top_p", [1e-9, 1, 1.0], [0, 0.0, 1.001, math.nan]),
    ("top_k", [0, 50], [-1]),
    ("min_p", [0, 1.0], [-0.01, 1.5]),
    ("logprobs", [None, 0, 20], [-1, 21]),
    ("draft_max", [None, 0, 64], [-1, 65]),
    ("seed", [None, -9999, 0, 2**40], []),
]


@pytest.mark.parametrize("name, good, bad", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_each_option_has_one_rule_with_its_bounds(name, good, bad):
    for value in good:
        assert getattr(GenerationOptions(**{name: value}), name) == value
    for value in bad:
        with pytest.raises(OptionError, match=f"^{name} must be ") as e:
            GenerationOptions(**{name: value})
        assert e.value.name == name


@pytest.mark.parametrize("name, value", [("max_tokens", 2.0), ("max_tokens", "8"), ("max_tokens", True),
                                         ("top_k", 2.5), ("seed", 1.5), ("seed", True), ("temperature", "0.5"),
                                         ("stop", [1]), ("stop", 5), ("grammar", 5)])
def test_values_of_the_wrong_type_are_rejected(name, value):
    with pytest.raises(OptionError, match=name):
        GenerationOptions(**{name: value})


def test_values_are_kept_as_the_engine_runs_them():
    o = GenerationOptions(stop="\n", speculative=0)
    assert o.stop == ("\n",) and o.speculative is False
    assert GenerationOptions(stop=["a", "b"]).stop == ("a", "b") and GenerationOptions(stop=None).stop == ()
    assert GenerationOptions() == GenerationOptions(**{name: rule.default for name, rule in OPTIONS.items()})
    assert GenerationOptions.build(o, max_tokens=3) == GenerationOptions(stop="\n", speculative=False, max_tokens=3)
    with pytest.raises(TypeError):
        GenerationOptions(temprature=1.0)
    with pytest.raises(TypeError):
        GenerationOptions.build({"max_tokens": 3})


def test_a_schema_or_a_grammar_compiles_once_and_not_both():
    from localspec.constraints import Constraint, ConstraintError

    o = GenerationOptions(schema={"type": "object"})
    assert isinstance(o.schema, Constraint) and o.constraint is o.schema and o.grammar is None
    assert GenerationOptions(schema=o.schema).schema is o.schema  # a Constraint is kept as it is
    assert GenerationOptions(grammar='root ::= "yes"').constraint.kind == "gbnf"
    with pytest.raises(ConstraintError, match="not both"):
        GenerationOptions(schema={"type": "object"}, grammar='root ::= "yes"')
    with pytest.raises(ConstraintError, match="Invalid type"):
        GenerationOptions(schema={"type": "nope"})
    assert GenerationOptions().constraint is None


@pytest.fixture
def checks(monkeypatch):
    """Every rule check from here on (any thread): the Option of each, in order."""
    seen: list[Option] = []
    check = Option.check
    monkeypatch.setattr(Option, "check", lambda self, value, shown=None: seen.append(self) or check(self, value, shown))
    return seen


def test_the_engine_takes_checked_options_as_they_are(checks):
    with pytest.raises(OptionError, match="top_p must be a number in \\(0, 1\\]"):
        SamplingParams(top_p=0)  # built on its own, it checks its values by the same rules
    o = GenerationOptions(max_tokens=5, temperature=0.5, top_k=3, seed=2, stop="x", logprobs=1,
                          logit_bias={"7": 1.5})
    checks.clear()
    r = Request.of(o)
    assert checks == []  # built from a GenerationOptions: checked when that was built, not again
    assert (r.max_tokens, r.stop, r.logprobs, r.speculative) == (5, ("x",), 1, True)
    assert r.sampling == SamplingParams(temperature=0.5, top_k=3, seed=2, logit_bias={7: 1.5})
    assert SamplingParams() == Request.of(GenerationOptions()).sampling  # the same defaults
    checks.clear()
    assert GenerationOptions.build(o) is o  # nothing to change: the same object, not checked again
    assert checks == []


# ---------------------------------------------------------------- the command line


def _param(command: str, name: str) -> click.Parameter:
    return next(p for p in main.commands[command].params if p.name == name)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_click_options_come_from_the_rules(command):
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop"):
        rule, param = OPTIONS[name], _param(command, name)
        assert param.help.startswith(rule.help) and param.default == (() if name == "stop" else rule.default)
        if rule.bounds:
            low = rule.ge if rule.gt is None else rule.gt
            assert (param.type.min, param.type.max, param.type.min_open) == (low, rule.le, rule.gt is not None)
    assert _param(command, "draft_max").type.max == OPTIONS["draft_max"].le


def test_help_text_reaches_the_command_line():
    out = " ".join(CliRunner().invoke(main, ["generate", "--help"], terminal_width=400).output.split())
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "schema", "grammar"):
        assert OPTIONS[name].help in out, name
    assert "--json-schema" in out and "--max-tokens INTEGER RANGE" in out and "[default: 256; x>=1]" in out


def test_every_rule_has_its_words():
    assert OPTIONS["top_p"].rule == "top_p must be a number in (0, 1] (1 = disabled)"
    assert OPTIONS["temperature"].rule == "temperature must be a finite number >= 0 (0 = greedy)"
    assert OPTIONS["draft_max"].rule == "draft_max must be an integer in [0, 64] or none"
    assert OPTIONS["seed"].rule == "seed must be an integer in [-2^63, 2^64 - 1] or none"
    with pytest.raises(OptionError) as e:
        GenerationOptions(top_k=-1)
    assert (e.value.name, e.value.rule, e.value.value) == ("top_k", OPTIONS["top_k"].rule, -1)
    assert str(e.value) == "top_k must be an integer >= 0 (0 = disabled), got -1"
    assert OPTIONS["temperature"].narrowed(le=2).rule == "temperature must be a number in [0, 2] (0 = greedy)"
    with pytest.raises(ValueError, match="looser"):
        OPTIONS["top_p"].narrowed(le=2)


def test_a_one_prompt_generate_gets_a_context_its_size():
    from localspec.cli.flags import CTX_STEP, DEFAULT_CTX, TEMPLATE_ALLOWANCE, fitted_context

    assert fitted_context(["hi", ""], 256) == 768  # 2 + 256 + 256 bytes' worth, rounded up to 256
    n = fitted_context(["\u00e9" * 100, "be brief"], 10)  # 200 + 8 bytes: a token per byte at most
    assert n >= 208 + TEMPLATE_ALLOWANCE + 10 and n % CTX_STEP == 0 and n - CTX_STEP < 208 + TEMPLATE_ALLOWANCE + 10
    assert fitted_context(["x" * 10_000, ""], 256) == DEFAULT_CTX  # never more than the default


# ---------------------------------------------------------------- one value, every interface

# (option, a value its rule rejects): every option with a bound, the finite rule of a number, and a
# type rule (a schema's rule is its compilation: constraints' tests)
REJECTED = [
    ("max_tokens", 0), ("max_tokens", 1.5), ("temperature", -0.5), ("temperature", math.inf), ("top_p", 0),
    ("top_p", 1.5), ("top_k", -1), ("min_p", 1.5), ("seed", "x"), ("stop", [1]), ("logprobs", 21),
    ("prompt_logprobs", -1), ("speculative", "yes"), ("draft_max", 65), ("draft_min", -1), ("draft_p_min", 1.5),
    ("logit_bias", {"5": 101}), ("sources", "yes"), ("grammar", 5),
]

# the server's field of each option (chat): its path in the body, as the error names it
SERVER_FIELDS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "min_p": "min_p", "seed": "seed", "logprobs": "top_logprobs", "speculative": "speculative.enabled",
                 "draft_max": "speculative.draft_max", "draft_min": "speculative.n_min",
                 "draft_p_min": "speculative.p_min", "logit_bias": "logit_bias", "sources": "speculative.sources",
                 "grammar": "grammar"}  # stop: its list's own errors name the item (test_server)
CLI_FLAGS = {name: f"--{name.replace('_', '-')}" for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                                                               "seed", "draft_max")}


def test_every_option_with_a_rule_is_tried():
    assert {name for name, _ in REJECTED} == {name for name, o in OPTIONS.items() if o.kind is not Kind.SCHEMA}
    assert set(SETTABLE) <= set(CLI_FLAGS) and set(SAMPLING_FIELDS) <= {name for name, _ in REJECTED}


@pytest.fixture(scope="module")
def http():
    from starlette.testclient import TestClient

    from localspec.server.app import create_app

    from serving import paced_engine

    engine = paced_engine(step=0.0, n_ctx=256)
    with TestClient(create_app(engine, model_name="m"), base_url="http://localhost") as client:
        client.engine = engine
        yield client


def _as_text(value) -> str | None:
    """The value typed on a command line or after /set, when it can be."""
    return str(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None


def _server_error(http, name, value) -> dict:
    path = SERVER_FIELDS[name]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    if name == "logprobs":
        body["logprobs"] = True
    if "." in path:
        outer, inner = path.split(".")
        body[outer] = {inner: value}
    else:
        body[path] = value
    n = len(http.engine.prepared)
    r = http.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert len(http.engine.prepared) == n  # refused before the engine
    err = r.json()["error"]
    assert err["param"] == path and err["code"] in ("invalid_value", "invalid_type"), err
    return err


@pytest.mark.parametrize("name, value", REJECTED, ids=[f"{n}={v!r}" for n, v in REJECTED])
def test_one_rule_rejects_a_value_with_the_same_words_everywhere(http, name, value):
    rule = OPTIONS[name].rule  # "top_p must be a number in (0, 1] (1 = disabled)"
    messages = {}
    with pytest.raises(OptionError) as e:  # the Python API
        GenerationOptions(**{name: value})
    messages["engine"] = str(e.value)
    text = _as_text(value)
    if name in CLI_FLAGS and text is not None:  # the command line: click's usage error, exit 2, nothing loaded
        result = CliRunner().invoke(main, ["generate", CLI_FLAGS[name], text, "hi"])
        assert result.exit_code == 2 and f"Invalid value for '{CLI_FLAGS[name]}'" in result.output, result.output
        messages["cli"] = result.output
    if name in SAMPLING_FIELDS:  # a batch line: its error record
        item = parse_line(json.dumps({"id": "x", "prompt": "hi", name: value}), 1, defaults=GenerationOptions(),
                          system=None, raw=False)
        messages["batch"] = item.error
    if name in SETTABLE and text is not None:  # the chat's /set
        with pytest.raises(SettingError) as e:
            set_option(Settings(), name, text)
        messages["set"] = str(e.value)
    if name in SERVER_FIELDS:  # the server: OpenAI's error body
        messages["server"] = _server_error(http, name, value)["message"]
    assert all(m is not None and rule in m for m in messages.values()), messages
    assert len(messages) > 1 or name == "prompt_logprobs", messages  # (the server's echo takes logprobs')


def test_the_servers_own_limit_is_one_more_rule(http):
    from localspec.server.schemas import OPENAI_TEMPERATURE

    assert GenerationOptions(temperature=3).temperature == 3  # the option's rule allows it ...
    assert set_option(Settings(), "temperature", "3")[1].temperature == 3.0
    err = _server_error(http, "temperature", 3)  # ... OpenAI's does not
    assert err["message"].startswith(f"Invalid value for 'temperature': {OPENAI_TEMPERATURE.rule}, got 3")
    assert OPENAI_TEMPERATURE.le == 2 and OPTIONS["temperature"].rule not in err["message"]


def test_a_request_is_checked_once_on_its_way_to_the_engine(http, checks):
    from localspec.server.schemas import OPENAI_TEMPERATURE

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0.5, "top_p": 0.9,
            "seed": 4, "logit_bias": {"5": 1}, "speculative": {"draft_max": 3}}
    n = len(http.engine.prepared)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(http.engine.prepared) == n + 1
    counted = Counter(o.name for o in checks if o is not OPENAI_TEMPERATURE)
    assert counted == Counter(list(OPTIONS)), counted  # each option's rule once, from the body to the engine's Request
    assert [o for o in checks if o is OPENAI_TEMPERATURE] == [OPENAI_TEMPERATURE]  # and OpenAI's limit once


def test_the_same_values_pass_everywhere(http, tmp_path):
    good = {"max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 7, "stop": ["\n"]}
    item = parse_line(json.dumps({"id": "x", "prompt": "hi", **good}), 1, defaults=GenerationOptions(), system=None,
                      raw=False)
    assert item.error is None and item.options == GenerationOptions(**good)
    s = Settings()
    for name, value in good.items():
        if name != "stop":
            s = set_option(s, name, str(value))[1]
    assert s == GenerationOptions(**good | {"stop": ()})
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **good,
                                                 "speculative": {"draft_max": 64}})
    assert r.status_code == 200, r.text
    assert http.engine.prepared[-1] == GenerationOptions(**good, draft_max=64)


def test_the_server_takes_its_bounds_and_help_from_the_rules():
    from localspec.server.schemas import ChatCompletionRequest, CompletionRequest, Speculative

    chat = ChatCompletionRequest.model_json_schema()["properties"]
    completion = CompletionRequest.model_json_schema()["properties"]
    spec = Speculative.model_json_schema()["properties"]

    def bounds(prop: dict) -> dict:
        number = next((t for t in prop.get("anyOf", [prop]) if t.get("type") in ("integer", "number")), {})
        names = {"minimum": "ge", "exclusiveMinimum": "gt", "maximum": "le"}
        return {names[k]: v for k, v in number.items() if k in names}

    for name in ("max_tokens", "top_p", "top_k", "min_p", "seed"):
        assert bounds(chat[name]) == OPTIONS[name].bounds, name
    assert bounds(chat["max_completion_tokens"]) == OPTIONS["max_tokens"].bounds
    assert bounds(chat["temperature"]) == OPTIONS["temperature"].bounds | {"le": 2}  # OpenAI's range
    assert bounds(chat["top_logprobs"]) == bounds(completion["logprobs"]) == OPTIONS["logprobs"].bounds
    assert bounds(spec["draft_max"]) == OPTIONS["draft_max"].bounds
    assert OPTIONS["top_k"].help[1:] in chat["top_k"]["description"] and \
        chat["top_k"]["description"].startswith("Extension: ")
    assert chat["seed"]["description"] == OPTIONS["seed"].help


def test_set_parses_text_by_the_rule():
    s = Settings()
    assert set_option(s, "Top-P", "0.5") == ("top_p", GenerationOptions(top_p=0.5))
    assert set_option(s, "seed", "random")[1].seed is None and set_option(s, "draft_max", "none")[1].draft_max is None
    for name, text, message in [("temperature", "abc",
                                 "temperature must be a finite number >= 0 (0 = greedy), got 'abc'"),
                                ("temperature", "inf", "temperature must be a finite number >= 0"),
                                ("top_p", "0", "top_p must be a number in (0, 1] (1 = disabled), got '0'"),
                                ("draft_max", "65", "draft_max must be an integer in [0, 64] or none, got '65'"),
                                ("max_tokens", "1.5", "max_tokens must be an integer >= 1, got '1.5'"),
                                ("seed", "x", "seed must be an integer in [-2^63, 2^64 - 1] or none, got 'x'"),
                                ("logprobs", "1", "unknown setting 'logprobs'")]:
        with pytest.raises(SettingError) as e:
            set_option(s, name, text)
        assert message in str(e.value), (name, text, str(e.value))
