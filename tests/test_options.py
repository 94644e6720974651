"""The one definition of the generation options (localspec.options): each rule's bounds, its help
reaching click, and the same rule rejecting the same value on the command line, in a batch line,
in the chat's /set, in the server's requests and in the engine. No models: the server runs over an
engine double."""

from __future__ import annotations

import json
import math

import click
import pytest
from click.testing import CliRunner

from localspec.cli.jobs import parse_line
from localspec.cli.commands import main
from localspec.runtime.engine import Request
from localspec.options import OPTIONS, GenerationOptions, OptionError
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


def test_the_engine_parts_use_the_same_rules():
    with pytest.raises(ValueError, match="top_p must be a number in \\(0, 1\\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        Request(max_tokens=0)
    with pytest.raises(ValueError, match="draft_max"):
        Request(draft_max=65)
    r = Request.of(GenerationOptions(max_tokens=5, temperature=0.5, top_k=3, seed=2, stop="x", logprobs=1))
    assert (r.max_tokens, r.stop, r.logprobs, r.speculative) == (5, ("x",), 1, True)
    assert r.sampling == SamplingParams(temperature=0.5, top_k=3, seed=2)
    assert SamplingParams() == Request.of(GenerationOptions()).sampling  # the same defaults


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


def test_a_one_prompt_generate_gets_a_context_its_size():
    from localspec.cli.commands import CTX_STEP, DEFAULT_CTX, TEMPLATE_ALLOWANCE, fitted_context

    assert fitted_context(["hi", ""], 256) == 768  # 2 + 256 + 256 bytes' worth, rounded up to 256
    n = fitted_context(["\u00e9" * 100, "be brief"], 10)  # 200 + 8 bytes: a token per byte at most
    assert n >= 208 + TEMPLATE_ALLOWANCE + 10 and n % CTX_STEP == 0 and n - CTX_STEP < 208 + TEMPLATE_ALLOWANCE + 10
    assert fitted_context(["x" * 10_000, ""], 256) == DEFAULT_CTX  # never more than the default


# ---------------------------------------------------------------- one value, every interface

# (option, a value its rule rejects, the CLI flag, the batch field, the server's field path or None)
REJECTED = [
    ("max_tokens", 0, "--max-tokens", "max_tokens", "max_tokens"),
    ("temperature", -0.5, "--temperature", "temperature", "temperature"),
    ("top_p", 0, "--top-p", "top_p", "top_p"),
    ("top_p", 1.5, "--top-p", "top_p", "top_p"),
    ("top_k", -1, "--top-k", "top_k", "top_k"),
    ("min_p", 1.5, "--min-p", "min_p", "min_p"),
    ("draft_max", 65, "--draft-max", None, "speculative.draft_max"),
    ("logprobs", 21, None, None, "top_logprobs"),
]


@pytest.fixture(scope="module")
def http():
    from starlette.testclient import TestClient

    from localspec.server.app import create_app

    from serving import paced_engine

    engine = paced_engine(step=0.0, n_ctx=256)
    with TestClient(create_app(engine, model_name="m"), base_url="http://localhost") as client:
        client.engine = engine
        yield client


@pytest.mark.parametrize("name, value, flag, field, param", REJECTED, ids=[f"{r[0]}={r[1]}" for r in REJECTED])
def test_the_same_rule_rejects_the_same_value_everywhere(http, name, value, flag, field, param):
    with pytest.raises(OptionError, match=name):  # the engine (the Python API)
        GenerationOptions(**{name: value})
    if flag is not None:  # the command line: click's error, exit 2, before anything loads
        result = CliRunner().invoke(main, ["generate", flag, str(value), "hi"])
        assert result.exit_code == 2 and f"Invalid value for '{flag}'" in result.output, result.output
    if field is not None:  # a batch line: an error record naming the option
        item = parse_line(json.dumps({"id": "x", "prompt": "hi", field: value}), 1, defaults={}, system=None,
                          raw=False)
        assert item.error is not None and item.error.startswith(f"{name} must be "), item.error
    if name in SETTABLE:  # the chat's /set
        with pytest.raises(SettingError, match="expected"):
            set_option(Settings(), name, str(value))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    if param == "speculative.draft_max":
        body["speculative"] = {"draft_max": value}
    elif param == "top_logprobs":
        body |= {"logprobs": True, "top_logprobs": value}
    else:
        body[param] = value
    n = len(http.engine.prepared)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, "invalid_value"), err
    assert len(http.engine.prepared) == n  # refused before the engine


def test_the_same_values_pass_everywhere(http, tmp_path):
    good = {"max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 7, "stop": ["\n"]}
    item = parse_line(json.dumps({"id": "x", "prompt": "hi", **good}), 1, defaults={}, system=None, raw=False)
    assert item.error is None and GenerationOptions(**item.options) == GenerationOptions(**good)
    s = Settings()
    for name, value in good.items():
        if name != "stop":
            s = set_option(s, name, str(value))[1]
    assert s == GenerationOptions(**good | {"stop": ()})
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **good,
                                                 "speculative": {"draft_max": 64}})
    assert r.status_code == 200, r.text
    assert GenerationOptions(**http.engine.prepared[-1]) == GenerationOptions(**good, draft_max=64)


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
    with pytest.raises(ValueError, match="looser"):
        OPTIONS["top_p"].wire_field(le=2)


def test_set_parses_text_by_the_rule():
    s = Settings()
    assert set_option(s, "Top-P", "0.5") == ("top_p", GenerationOptions(top_p=0.5))
    assert set_option(s, "seed", "random")[1].seed is None and set_option(s, "draft_max", "none")[1].draft_max is None
    for name, text, message in [("temperature", "abc", "expected a number >= 0, got 'abc'"),
                                ("temperature", "inf", "expected a number >= 0"),
                                ("top_p", "0", "expected a number in (0, 1], got '0'"),
                                ("draft_max", "65", "expected an integer in [0, 64] or none"),
                                ("max_tokens", "1.5", "expected an integer >= 1"),
                                ("seed", "x", "expected an integer or none"),
                                ("logprobs", "1", "unknown setting 'logprobs'")]:
        with pytest.raises(SettingError) as e:
            set_option(s, name, text)
        assert message in str(e.value), (name, text, str(e.value))
