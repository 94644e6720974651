"""Generation options: every per-request option defined once (name, type, default, bounds, help).

`GenerationOptions` is what `Engine.stream` / `Engine.generate` take: a frozen dataclass whose
fields each carry an `Option` (their rule). Building one checks a request's options by their
rules; every interface builds one from what it was given and hands that object on, and the engine
turns it into a `sequence.Request` without checking it again:

* `localspec generate` / `chat` build their click options with `click_option` (type, bounds,
  default, help; click checks a flag's value by its rule as it parses it, so that a bad value is
  a usage error naming the flag, before any model loads);
* a batch line's fields replace the command line's in its `GenerationOptions`;
* the chat's `/set NAME VALUE` parses with `GenerationOptions.with_text`;
* the server's request fields take their bounds and descriptions from the rules (server/schemas.py)
  and become a `GenerationOptions` (keeping OpenAI's wire names and defaults), the server's
  narrower OpenAI limits checked on it after the rules (`Option.narrowed`).

So one rule rejects the same value everywhere with the same words (`Option.rule`: "top_p must be a
number in (0, 1] (1 = disabled)"); only the frame around them follows each interface (a CLI flag,
a JSON field, a /set command) and how the rejected value is quoted. Nothing here imports click,
pydantic or llguidance until a derivation or a schema/grammar needs it.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

NONE_WORDS = ("none", "off", "default", "random")  # what /set takes for "no value" (seed: random)


DEFAULT_CTX = 4096  # tokens one sequence may hold unless --ctx / n_ctx says otherwise (an engine setting)
# tokens of earlier requests' text the suffix cache keeps per pool (~28 MB a million: speculative/suffix.py)
DEFAULT_SUFFIX_CACHE = 1_000_000
# MiB of host memory that keep finished sequences' oracle caches for later prompts (runtime/prompt_cache.py)
DEFAULT_PROMPT_CACHE_MIB = 2048


def _integer_words(value: float) -> str:
    """An integer bound in words: 64, or a power of two as one (a seed's 2^64 - 1)."""
    value = int(value)
    for k in (63, 64):
        for exact, words in (((1 << k) - 1, f"2^{k} - 1"), (1 << k, f"2^{k}"), (-(1 << k), f"-2^{k}")):
            if value == exact:
                return words
    return str(value)


class OptionError(ValueError):
    """A generation option with a value its rule does not allow: `name` is the option's, `rule` its
    rule in words (`Option.rule`), `value` what was given. The message quotes the value as Python
    writes it unless `shown` says how (the text typed on a command line)."""

    def __init__(self, name: str, rule: str, value: Any, shown: str | None = None) -> None:
        super().__init__(f"{rule}, got {repr(value) if shown is None else shown}")
        self.name, self.rule, self.value = name, rule, value

    def in_json(self) -> str:
        """The message with the value as JSON writes it (a batch line, a request body)."""
        try:
            shown = json.dumps(self.value, ensure_ascii=False)
        except (TypeError, ValueError):
            shown = repr(self.value)
        return f"{self.rule}, got {shown}"


class Kind(enum.Enum):
    """What an option's values are."""

    INT = "int"  # an integer (not a bool)
    NUMBER = "number"  # a real number (not a bool); finite
    BOOL = "bool"
    STOPS = "stops"  # a string or a list of strings
    SCHEMA = "schema"  # a JSON schema: a dict, its text or a pydantic model class
    GRAMMAR = "grammar"  # Lark or GBNF text (or a compiled constraints.Constraint)
    BIAS = "bias"  # {token id: bias} or (token id, bias) pairs


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_stops(v: object) -> bool:
    return v is None or isinstance(v, str) or (isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v))


def _is_bias(v: object) -> bool:
    """{token id: bias} (ids as ints, or as the digit strings of JSON keys), or (id, bias) pairs."""
    if v is None:
        return True
    pairs = v.items() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else None
    if pairs is None:
        return False
    try:
        return all((_is_int(t) or (isinstance(t, str) and t.strip().isdigit())) and _is_real(b) for t, b in pairs)
    except (TypeError, ValueError):
        return False


LOGIT_BIAS_LIMIT = 100.0  # OpenAI's: -100 bans a token, 100 all but forces it


def _is_grammar(v: object) -> bool:
    from localspec.constraints import Constraint

    return isinstance(v, (str, Constraint))


_TYPE_OK: dict[Kind, Callable[[Any], bool]] = {
    Kind.INT: _is_int, Kind.NUMBER: _is_real, Kind.BOOL: lambda v: v in (True, False), Kind.STOPS: _is_stops,
    Kind.SCHEMA: lambda v: True, Kind.GRAMMAR: _is_grammar, Kind.BIAS: _is_bias}
_NONE_IS_EMPTY = (Kind.STOPS, Kind.SCHEMA, Kind.GRAMMAR, Kind.BIAS)  # None means "none of it"


@dataclass(frozen=True)
class Option:
    """One option's rule. `kind`: what its values are (`Kind`). Bounds: `ge`/`gt` below, `le`
    above. `nullable`: None is a value (seed: random, draft_max: the engine's). `note`: what a
    special value means, in messages."""

    kind: Kind
    default: Any
    help: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    nullable: bool = False
    note: str = ""
    flag: str = ""  # the CLI flag and the batch field, when not the option's own name (schema: json_schema)
    name: str = ""  # set from the field it belongs to

    # -- the rule

    def type_ok(self, value: Any) -> bool:
        if value is None:
            return self.nullable or self.kind in _NONE_IS_EMPTY
        return _TYPE_OK[self.kind](value)

    def in_bounds(self, value: Any) -> bool:
        if self.kind is Kind.BIAS:
            return value is None or all(-LOGIT_BIAS_LIMIT <= float(b) <= LOGIT_BIAS_LIMIT and int(t) >= 0
                                        for t, b in (value.items() if isinstance(value, dict) else value))
        if value is None or self.kind not in (Kind.INT, Kind.NUMBER):
            return True
        # written as `not (ok)` so that NaN fails every comparison
        if self.kind is Kind.NUMBER and not (-math.inf < value < math.inf):
            return False
        return not ((self.ge is not None and not value >= self.ge) or (self.gt is not None and not value > self.gt)
                    or (self.le is not None and not value <= self.le))

    def check(self, value: Any, shown: str | None = None) -> Any:
        """The value as the engine keeps it (stop: a tuple; speculative: a bool); OptionError when
        the rule rejects it (`shown`: how its message quotes the value). A schema or grammar is
        checked by compiling it (GenerationOptions)."""
        if not (self.type_ok(value) and self.in_bounds(value)):
            raise OptionError(self.name, self.rule, value, shown)
        if self.kind is Kind.STOPS:
            return (value,) if isinstance(value, str) else tuple(value or ())
        if self.kind is Kind.BIAS:  # ((token id, bias), ...) by id: hashable, one entry per id
            pairs = value.items() if isinstance(value, dict) else value or ()
            return tuple(sorted({int(t): float(b) for t, b in pairs if float(b) != 0.0}.items()))
        if self.kind is Kind.BOOL:
            return bool(value)
        return value

    def narrowed(self, *, note: str | None = None, **tighter: float) -> "Option":
        """This rule with tighter bounds (an interface's own limit: OpenAI's temperature stops at
        2); ValueError when one is looser than the rule's."""
        for key, value in tighter.items():
            own = self.bounds.get(key)
            if own is not None and (value < own if key in ("ge", "gt") else value > own):
                raise ValueError(f"{self.name}: a bound {key}={value} is looser than the option's {own}")
        return replace(self, **tighter, **({} if note is None else {"note": note}))

    # -- words

    @property
    def rule(self) -> str:
        """The rule in words, the same in every interface: "top_p must be a number in (0, 1]
        (1 = disabled)"."""
        note = f" ({self.note})" if self.note else ""
        return f"{self.name} must be {self.expected}{note}"

    @property
    def expected(self) -> str:
        """What the rule allows, in words: "an integer in [0, 64] or none"."""
        words = {Kind.INT: "an integer", Kind.NUMBER: "a finite number" if self.le is None else "a number",
                 Kind.BOOL: "true or false", Kind.STOPS: "a string or a list of strings",
                 Kind.SCHEMA: "a JSON schema", Kind.GRAMMAR: "a string",
                 Kind.BIAS: f"a map of token ids to biases in [{-LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"}[self.kind]
        low = self.ge if self.gt is None else self.gt
        say = _integer_words if self.kind == Kind.INT else "{:g}".format
        if low is not None and self.le is not None:
            words += f" in {'(' if self.gt is not None else '['}{say(low)}, {say(self.le)}]"
        elif low is not None:
            words += f" {'>' if self.gt is not None else '>='} {say(low)}"
        elif self.le is not None:
            words += f" <= {say(self.le)}"
        return words + (" or none" if self.nullable else "")

    @property
    def bounds(self) -> dict[str, float]:
        """The bounds, as pydantic's Field and the JSON schema spell them."""
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le)) if v is not None}

    # -- the interfaces

    def parse_text(self, text: str) -> Any:
        """A value typed as text (`/set NAME VALUE`, a command-line flag), checked by the rule;
        OptionError (quoting the text) otherwise. A nullable option takes NONE_WORDS for None."""
        value: Any = None
        if not (self.nullable and text.strip().lower() in NONE_WORDS):
            try:
                value = {Kind.INT: int, Kind.NUMBER: float}[self.kind](text)
            except (KeyError, ValueError):
                raise OptionError(self.name, self.rule, text, repr(text)) from None
        return self.check(value, repr(text))

    def click_option(self, *decls: str, **overrides: Any) -> Callable:
        """The click option of this rule: its type, whose values the rule parses and checks (an
        error is click's usage error with the rule's words), with the bounds shown in --help, its
        default and its help (a list option is repeatable; a schema or grammar is read from a
        file). `overrides` replace any of click's arguments (another command's default, a more
        specific help)."""
        import click

        flag = f"--{(self.flag or self.name).replace('_', '-')}"
        kw: dict[str, Any] = {"default": self.default, "help": self.help}
        if self.kind in (Kind.INT, Kind.NUMBER):
            kw["type"] = _click_type(self)
        elif self.kind is Kind.STOPS:
            kw.update(multiple=True, default=(), help=f"{self.help} Repeatable.")
        elif self.kind in (Kind.SCHEMA, Kind.GRAMMAR):
            kw.update(type=click.Path(exists=True, dir_okay=False, allow_dash=True),
                      help=f"{self.help} Give a file ('-': stdin).")
        kw.update(overrides)
        if kw.get("default") is not None and kw["default"] != () and "show_default" not in kw:
            kw["show_default"] = True
        return click.option(*(decls or (flag, self.flag or self.name)), **kw)


def _click_type(option: Option) -> Any:
    """A click type for a numeric option: click's own (IntRange, FloatRange, INT, FLOAT: their
    metavar and the range in --help), its conversion replaced by the option's rule."""
    import click

    low = option.ge if option.gt is None else option.gt
    if low is None and option.le is None:
        base, args = (click.types.IntParamType if option.kind is Kind.INT else click.types.FloatParamType), {}
    else:
        base = click.IntRange if option.kind is Kind.INT else click.FloatRange
        args = {"min": low, "max": option.le, "min_open": option.gt is not None}

    class RuleType(base):
        def convert(self, value, param, ctx):
            try:
                return option.parse_text(value) if isinstance(value, str) else option.check(value)
            except OptionError as e:
                self.fail(str(e), param, ctx)

    return RuleType(**args)


def option(kind: Kind, default: Any, help: str, **rule: Any) -> Any:
    """A GenerationOptions field with its rule."""
    return field(default=default, metadata={"option": Option(kind, default, help, **rule)})


@dataclass(frozen=True)
class GenerationOptions:
    """One generation request's options, checked on construction (OptionError, a ValueError,
    naming the option; an invalid schema or grammar is a constraints.ConstraintError). `stop`
    becomes a tuple; `schema` / `grammar` are compiled to a `constraints.Constraint`."""

    max_tokens: int = option(Kind.INT, 256, "Most tokens to generate.", ge=1)
    temperature: float = option(Kind.NUMBER, 0.0, "0 is greedy.", ge=0, note="0 = greedy")
    top_p: float = option(Kind.NUMBER, 1.0, "Keep the most likely tokens whose probabilities add up to top_p "
                                            "(1 disables).", gt=0, le=1, note="1 = disabled")
    top_k: int = option(Kind.INT, 0, "Keep the k most likely tokens (0 disables).", ge=0, note="0 = disabled")
    min_p: float = option(Kind.NUMBER, 0.0, "Keep the tokens at least min_p times as likely as the most likely "
                                            "one (0 disables).", ge=0, le=1, note="0 = disabled")
    seed: int | None = option(Kind.INT, None, "Makes sampled output reproducible (a 64-bit integer, signed or "
                                              "not).", nullable=True, ge=-(1 << 63), le=(1 << 64) - 1)
    stop: tuple[str, ...] = option(Kind.STOPS, (), "Stop string: the output ends before it.")
    logprobs: int | None = option(Kind.INT, None, "Return the oracle's log-probability of each emitted token, and "
                                                  "of this many most likely tokens.", ge=0, le=20, nullable=True)
    prompt_logprobs: int | None = option(Kind.INT, None, "Also return the oracle's log-probability of each prompt "
                                                         "token (the first has none), and of this many most likely "
                                                         "tokens.", ge=0, le=20, nullable=True)
    speculative: bool = option(Kind.BOOL, True, "false: the oracle alone (same output, no draft).")
    draft_max: int | None = option(Kind.INT, None, "Most tokens drafted per step for this request.", ge=0, le=64,
                                   nullable=True)
    draft_min: int | None = option(Kind.INT, None, "A draft shorter than this is not verified (the step runs "
                                                   "without it; llama-server's speculative.n_min).", ge=0, le=64,
                                   nullable=True)
    draft_p_min: float | None = option(Kind.NUMBER, None, "The draft model stops drafting once its top probability "
                                                          "falls below this (llama-server's speculative.p_min; "
                                                          "default: the engine's).", ge=0, le=1, nullable=True)
    logit_bias: tuple[tuple[int, float], ...] = option(
        Kind.BIAS, (), "Added to the oracle's logits of these token ids before sampling (the draft's too): the "
                       "output follows the biased oracle.")
    sources: bool = option(Kind.BOOL, False, "Label each chunk's text by where its tokens came from: accepted from "
                                             "the draft model, from prompt lookup, or the oracle's own token.")
    schema: Any = option(Kind.SCHEMA, None, "The output must be JSON following this JSON schema.", flag="json_schema")
    grammar: Any = option(Kind.GRAMMAR, None, "The output must follow this grammar (llguidance's Lark syntax, or "
                                              "llama.cpp's GBNF when it has '::=' rules).")

    def __post_init__(self) -> None:
        for name, rule in OPTIONS.items():
            value = rule.check(getattr(self, name))
            if value is not getattr(self, name):
                object.__setattr__(self, name, value)
        if self.schema is not None or self.grammar is not None:
            from localspec.constraints import Constraint, ConstraintError

            if self.schema is not None and self.grammar is not None:
                raise ConstraintError("give a schema or a grammar, not both")
            if self.schema is not None and not isinstance(self.schema, Constraint):
                object.__setattr__(self, "schema", Constraint.json_schema(self.schema))
            if self.grammar is not None and not isinstance(self.grammar, Constraint):
                object.__setattr__(self, "grammar", Constraint.from_grammar(self.grammar))

    @classmethod
    def build(cls, options: "GenerationOptions | None" = None, **changes: Any) -> "GenerationOptions":
        """`options` (default: the defaults) with `changes` (field names) applied."""
        if options is None:
            return cls(**changes)
        if not isinstance(options, cls):
            raise TypeError(f"expected GenerationOptions, got {type(options).__name__}")
        return replace(options, **changes) if changes else options

    @property
    def constraint(self):
        """The compiled schema or grammar (a constraints.Constraint), or None."""
        return self.schema if self.schema is not None else self.grammar

    def with_text(self, name: str, text: str) -> "GenerationOptions":
        """A copy with option `name` set from text (`/set temperature 0.7`); OptionError (a
        ValueError) saying the rule."""
        return replace(self, **{name: OPTIONS[name].parse_text(text)})


OPTIONS: dict[str, Option] = {}
for _f in fields(GenerationOptions):
    OPTIONS[_f.name] = replace(_f.metadata["option"], name=_f.name)
del _f
