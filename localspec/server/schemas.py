"""OpenAI request and response bodies (the subset localspec serves), as pydantic models.

Requests are strict, as with OpenAI: an unknown field is a 400 ("Unrecognized request argument
supplied"), values must have their JSON type ("8" is not an integer, true is not a seed, 8.0 is
not an integer either), and a parameter the engine cannot honour (penalties, the legacy
`functions`, ...) is a 400 rather than silently ignored. `response_format`, `tools` and
`tool_choice` are served by server/tools.py. Responses (server/responses.py, re-exported here)
follow OpenAI's schema; `usage` also carries the speculative-decoding counters (drafted, accepted,
acceptance_rate).

A generation option's field (`option_field`) takes its description and the bounds its JSON schema
shows from the option's rule (localspec.options), and pydantic checks only its JSON type (an error
that says the rule). The rule itself runs once, when the request becomes a `GenerationOptions`
(`generation_options`), followed by the server's narrower OpenAI limits (`OPENAI_LIMITS`).
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from localspec.options import OPTIONS, GenerationOptions, Option, OptionError
from localspec.server.responses import (  # noqa: F401 (the response bodies: callers take them from here)
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChoiceLogprobs,
    Completion, CompletionChoice, CompletionLogprobs, Delta, ErrorDetail, ErrorResponse, FunctionCall,
    LogprobEntry, Model, ModelList, PromptTokensDetails, ReplyFigures, SourceCounts, SpeculationReport,
    ToolCall, TopLogprobEntry, Usage)

MAX_STOP = 16  # OpenAI allows 4; more costs nothing here
MAX_CHOICES = 16  # choices one request may ask for (n, and prompts x n for a list of prompts)
# logit_bias entries one request may give: a text key is tokenized before the request is queued, and a
# request of 300,000 of them (a 4 MB body) took 8.7 s of that; OpenAI's own limit is lower still
MAX_LOGIT_BIAS = 1024


class InvalidParam(ValueError):
    """A well-formed request asking for something unsupported: a 400 naming the parameter.
    `code`: unsupported_parameter (localspec has no such feature), unsupported_value (only some
    values work), invalid_value (a combination that makes no sense)."""

    def __init__(self, message: str, param: str | None = None, code: str = "unsupported_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


_STRICT = ConfigDict(extra="forbid", strict=True)

# the server's own rules beside the options' (OpenAI's): checked after them, on the GenerationOptions
OPENAI_TEMPERATURE = OPTIONS["temperature"].narrowed(le=2, note="0 = greedy; OpenAI's range")
OPENAI_LIMITS = (OPENAI_TEMPERATURE,)


# ---------------------------------------------------------------- requests


class _OptionSchema:
    """What a generation option's field keeps of its rule: the bounds, written into the field's
    JSON schema (on its number type; called by pydantic), and the rule's words for a value of the
    wrong JSON type (`types`: False leaves pydantic's own error, whose location points into a list)."""

    _NAMES = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum"}

    def __init__(self, option: Option, types: bool) -> None:
        self.option, self.types = option, types

    def __call__(self, schema: dict[str, Any]) -> None:
        for branch in schema.get("anyOf", [schema]):
            if branch.get("type") in ("integer", "number"):
                branch.update({self._NAMES[k]: v for k, v in self.option.bounds.items()})


def option_field(option: Option, default: Any = None, *, description: str | None = None, extension: bool = False,
                 alias: str | None = None, types: bool = True) -> Any:
    """The field of a generation option: its help as the description (or `description`;
    `extension`: a field OpenAI does not have says so) and its bounds in the JSON schema. The
    bounds are not checked here: building the request's GenerationOptions does."""
    text = description or option.help
    if extension:
        text = f"Extension: {text[0].lower()}{text[1:]}"
    return Field(default, description=text, json_schema_extra=_OptionSchema(option, types),
                 **({"alias": alias} if alias else {}))


class _Body(BaseModel):
    """A strict request body (or part of one): an unknown field is an error, and a value must have
    its JSON type; for an option's field that error says the option's rule."""

    model_config = _STRICT

    @field_validator("*", mode="wrap")
    @classmethod
    def _option_type(cls, value: Any, handler: Callable[[Any], Any], info) -> Any:
        kept = cls.model_fields[info.field_name].json_schema_extra
        if not (isinstance(kept, _OptionSchema) and kept.types):
            return handler(value)
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("option_type", "{rule}", {"rule": kept.option.rule}) from None


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted, nothing to obfuscate


class Speculative(_Body):
    """localspec's per-request extension: `"speculative": {"enabled": false, "draft_max": 6, "sources": true}`;
    llama-server's names are accepted too (`n_max` for draft_max, `n_min`, `p_min`)."""

    enabled: bool = option_field(OPTIONS["speculative"], True)
    draft_max: int | None = option_field(OPTIONS["draft_max"])
    n_max: int | None = option_field(OPTIONS["draft_max"], description="llama-server's name of draft_max.")
    n_min: int | None = option_field(OPTIONS["draft_min"])
    p_min: float | None = option_field(OPTIONS["draft_p_min"])
    sources: bool = option_field(
        OPTIONS["sources"], False,
        description="Each choice also says where its text came from: its `speculative.sources` cut the text at its "
                    "tokens, each piece with its token's source; its last chunk adds the reply's "
                    "`speculative.figures`.")


class _Common(_Body):
    """Sampling and control parameters shared by /v1/chat/completions and /v1/completions."""

    model: str | None = Field(None, description="The served model name (or the oracle's registry name).")
    max_tokens: int | None = option_field(
        OPTIONS["max_tokens"],
        description="Most tokens to generate (clamped to the server's --max-tokens-limit; default: that limit).")
    temperature: float | None = option_field(
        OPENAI_TEMPERATURE, description="0 is greedy; omitted means 1, as with OpenAI (which allows up to 2).")
    top_p: float | None = option_field(OPTIONS["top_p"])
    top_k: int | None = option_field(OPTIONS["top_k"], extension=True)
    min_p: float | None = option_field(OPTIONS["min_p"], extension=True)
    seed: int | None = option_field(OPTIONS["seed"])
    stop: str | list[str] | None = option_field(
        OPTIONS["stop"], types=False,
        description=f"A stop string, or a list of at most {MAX_STOP}: the output ends before the first found.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description=f"Choices to generate (1-{MAX_CHOICES}), together in one "
                   "batch; with a seed, choice i uses seed + i, so each choice is reproducible.")
    presence_penalty: float = Field(0.0, description="Only 0 is supported.")
    frequency_penalty: float = Field(0.0, description="Only 0 is supported.")
    logit_bias: dict[str, float] | None = option_field(
        OPTIONS["logit_bias"], types=False,
        description="Token id (as a string) -> a bias in [-100, 100] added to the oracle's logits; under "
                    "speculation the output follows the biased oracle exactly. A key that is not a token id "
                    "is text (as llama-server takes it): every token it tokenizes to gets the bias.")
    user: str | None = Field(None, description="Ignored.")
    speculative: Speculative | bool | None = Field(
        None, description="Extension: `{\"enabled\": false}` runs the oracle alone; `draft_max` caps the draft.")
    grammar: str | None = option_field(OPTIONS["grammar"], extension=True)
    # llama-server's per-request speculative fields, top-level keys with a dot in their names
    speculative_n_max: int | None = option_field(OPTIONS["draft_max"], alias="speculative.n_max", extension=True)
    speculative_n_min: int | None = option_field(OPTIONS["draft_min"], alias="speculative.n_min", extension=True)
    speculative_p_min: float | None = option_field(OPTIONS["draft_p_min"], alias="speculative.p_min", extension=True)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        """The keys (the biases are the option's rule)."""
        if any(not token for token in v or {}):
            raise ValueError("keys must be token ids (digit strings) or text, got an empty string")
        if len(v or {}) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return v

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidParam("stream_options: only allowed when stream is true", "stream_options", "invalid_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidParam(f"{name}: not supported (only 0)", name)

    def bias_by_id(self, tokenize: Callable[[str], list[int]]) -> None:
        """Turn `logit_bias`'s text keys into token ids, in place: each text's every token gets its
        bias (a later key's bias wins for a token two keys share), as llama-server does."""
        if not self.logit_bias or all(key.isdigit() for key in self.logit_bias):
            return
        by_id: dict[str, float] = {}
        for key, bias in self.logit_bias.items():
            for token in ([int(key)] if key.isdigit() else tokenize(key)):
                by_id[str(token)] = bias
        self.logit_bias = by_id

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return [s for s in stops if s]

    def generation_options(self, max_tokens_limit: int, constraint: Any = None) -> GenerationOptions:
        """The request as localspec's options, checked once: by the options' rules, then by the
        server's OpenAI limits; a value either rejects is an InvalidParam naming the client's field.
        An omitted field takes the option's default, except the temperature (1, as with OpenAI);
        max_tokens is clamped to the server's limit. `constraint`: the schema or grammar the
        route made of response_format, tools or grammar."""
        given = self._given(max_tokens_limit)
        try:
            options = GenerationOptions(**{name: value for name, (_, value) in given.items()}, grammar=constraint)
            for limit in OPENAI_LIMITS:
                limit.check(getattr(options, limit.name))
        except OptionError as e:
            param = given[e.name][0] if e.name in given else e.name
            raise InvalidParam(f"Invalid value for '{param}': {e.in_json()}.", param, "invalid_value") from None
        return options

    def _given(self, max_tokens_limit: int) -> dict[str, tuple[str, Any]]:
        """The options this request gives: option name -> (the client's path to the field that
        gives it, its value). `speculative` may be a bool or {"enabled", "draft_max", ...};
        llama-server's names give what localspec's do not."""
        spec = self.speculative if isinstance(self.speculative, Speculative) else None

        def of_spec(name: str) -> Any:
            return getattr(spec, name) if spec is not None else None

        fields = [*self._endpoint_fields(max_tokens_limit),
                  ("temperature", "temperature", 1.0 if self.temperature is None else self.temperature),
                  ("top_p", "top_p", self.top_p), ("top_k", "top_k", self.top_k), ("min_p", "min_p", self.min_p),
                  ("seed", "seed", self.seed), ("stop", "stop", self.stop_list()),
                  ("logit_bias", "logit_bias", self.logit_bias or None),
                  ("speculative", "speculative.enabled", of_spec("enabled")),
                  ("speculative", "speculative", self.speculative if isinstance(self.speculative, bool) else None),
                  ("draft_max", "speculative.draft_max", of_spec("draft_max")),
                  ("draft_max", "speculative.n_max", of_spec("n_max")),
                  ("draft_max", "speculative.n_max", self.speculative_n_max),
                  ("draft_min", "speculative.n_min", of_spec("n_min")),
                  ("draft_min", "speculative.n_min", self.speculative_n_min),
                  ("draft_p_min", "speculative.p_min", of_spec("p_min")),
                  ("draft_p_min", "speculative.p_min", self.speculative_p_min),
                  ("sources", "speculative.sources", of_spec("sources"))]
        given: dict[str, tuple[str, Any]] = {}
        for name, path, value in fields:
            if value is not None and name not in given:
                given[name] = (path, value)
        return given

    def _endpoint_fields(self, max_tokens_limit: int) -> list[tuple[str, str, Any]]:
        """The endpoint's own fields of the options (max_tokens, logprobs): (option, path, value)."""
        raise NotImplementedError


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_calls, tool_call_id, refusal, ...

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        out = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise InvalidParam(f"messages[{index}].content[{j}]: only text content is supported (got {part.type!r})",
                                   f"messages[{index}].content")
            out.append(part.text)
        return "".join(out)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = option_field(
        OPTIONS["max_tokens"],
        description="Most tokens to generate (wins over max_tokens; clamped to the server's --max-tokens-limit).")
    logprobs: bool = Field(False, description="Return the oracle's log-probability of each emitted token.")
    top_logprobs: int | None = option_field(
        OPTIONS["logprobs"], description="With logprobs: also return this many most likely tokens at each position.")
    response_format: dict[str, Any] | None = Field(
        None, description="{\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                          "\"json_schema\": {\"name\", \"schema\", \"strict\"}}: the output is constrained to it.")
    tools: list[dict[str, Any]] | None = Field(None, description="Functions the model may call ({\"type\": \"function\", "
                                                                 "\"function\": {\"name\", \"description\", \"parameters\"}}).")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="\"auto\" (default with tools), \"none\", \"required\" or {\"type\": \"function\", "
                          "\"function\": {\"name\"}}.")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per reply.")
    functions: list[dict[str, Any]] | None = Field(None, description="Not supported (only empty).")
    function_call: str | dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None  # ignored
    store: bool | None = None  # ignored: nothing is stored
    service_tier: str | None = None  # ignored
    reasoning_effort: str | None = None  # ignored

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParam("top_logprobs requires logprobs: true", "top_logprobs", "invalid_value")
        if self.functions or self.function_call:
            raise InvalidParam("functions: the legacy function calling is not supported (use tools)", "functions",
                               "unsupported_parameter")

    def engine_messages(self) -> list[dict[str, Any]]:
        """The messages as the engine renders them: role and text, and a tool call's fields."""
        out = []
        for i, m in enumerate(self.messages):
            message: dict[str, Any] = {"role": m.role, "content": m.text(i)}
            extra = m.model_extra or {}
            if m.role == "assistant" and extra.get("tool_calls"):
                message["tool_calls"] = _tool_calls(extra["tool_calls"], i)
            if m.role == "tool":
                if extra.get("tool_call_id") is not None and not isinstance(extra["tool_call_id"], str):
                    raise InvalidParam(f"messages[{i}].tool_call_id: must be a string", f"messages[{i}].tool_call_id")
                message["tool_call_id"] = extra.get("tool_call_id")
            if isinstance(extra.get("name"), str):
                message["name"] = extra["name"]
            out.append(message)
        return out

    def _endpoint_fields(self, max_tokens_limit: int) -> list[tuple[str, str, Any]]:
        """max_tokens (max_completion_tokens wins; default: the server's limit, which also clamps
        it) and the logprobs (top_logprobs, with logprobs: true)."""
        param, asked = next(((p, v) for p, v in (("max_completion_tokens", self.max_completion_tokens),
                                                 ("max_tokens", self.max_tokens)) if v is not None),
                            ("max_tokens", max_tokens_limit))
        return [("max_tokens", param, min(asked, max_tokens_limit)),
                ("logprobs", "top_logprobs", (self.top_logprobs or 0) if self.logprobs else None)]


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise InvalidParam(f"{where}: must be a list", where)
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("arguments", ""), (str, dict)):
            raise InvalidParam(f"{where}[{j}]: expected {{\"id\", \"type\": \"function\", \"function\": "
                               f"{{\"name\", \"arguments\"}}}}", where)
        out.append({"id": c.get("id"), "type": "function",
                    "function": {"name": f["name"], "arguments": f.get("arguments", "{}")}})
    return out


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description=f"A string, token ids, or a list of up to {MAX_CHOICES} strings or token-id lists (each its "
                         "own choices, generated together in one batch).")
    max_tokens: int | None = option_field(
        OPTIONS["max_tokens"],
        description="Most tokens to generate (default 16, as with OpenAI; clamped to the server's --max-tokens-limit).")
    logprobs: int | None = option_field(
        OPTIONS["logprobs"], description="Return the oracle's logprobs and this many top tokens.")
    echo: bool = Field(False, description="The prompt in front of the text (with logprobs, its tokens' too: "
                                          "the first one null).")
    best_of: int | None = Field(None, description="Only 1.")
    suffix: str | None = Field(None, description="Not supported.")

    def check_supported(self) -> None:
        super().check_supported()
        prompts = self.prompts()
        if not 1 <= len(prompts) <= MAX_CHOICES or not all(isinstance(p, str) or p for p in prompts):
            raise InvalidParam(f"prompt: give a string, token ids, or a list of 1 to {MAX_CHOICES} strings or "
                               "non-empty token-id lists", "prompt")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise InvalidParam(f"n: at most {MAX_CHOICES} choices in all (prompts x n)", "n")
        if self.best_of not in (None, 1):
            raise InvalidParam("best_of: only 1 is supported", "best_of")
        if self.suffix:
            raise InvalidParam("suffix: not supported", "suffix", "unsupported_parameter")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a string or a list of token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    def _endpoint_fields(self, max_tokens_limit: int) -> list[tuple[str, str, Any]]:
        """max_tokens (default 16, clamped to the server's limit) and the logprobs (with echo, the
        prompt's too)."""
        asked = 16 if self.max_tokens is None else self.max_tokens
        return [("max_tokens", "max_tokens", min(asked, max_tokens_limit)), ("logprobs", "logprobs", self.logprobs),
                ("prompt_logprobs", "logprobs", self.logprobs if self.echo else None)]
