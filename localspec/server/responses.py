"""OpenAI's response bodies (the subset localspec serves), as pydantic models: they follow OpenAI's
schema, and `usage` also carries the speculative-decoding counters (drafted, accepted,
acceptance_rate); a choice carries localspec's `speculative` report when the request asks for it.
The request bodies are server/schemas.py's, which re-exports these.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer


def _left_out_when_none(name: str):
    """A model's serializer that leaves field `name` out of the body where it is None (OpenAI sends
    it only when there is one)."""

    @model_serializer(mode="wrap")
    def serialize(self, handler):
        d = handler(self)
        if d.get(name) is None:
            d.pop(name, None)
        return d

    return serialize


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens reused, not evaluated: the slot's cache, another slot's or the prompt cache's.")


class SourceCounts(BaseModel):
    drafted: int = Field(description="Draft tokens this source proposed.")
    accepted: int = Field(description="Of those, accepted by the oracle.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    steps: int = Field(0, description="Speculative steps (oracle verify passes) the generation took.")
    drafted: int = Field(0, description="Draft tokens proposed.")
    accepted: int = Field(0, description="Draft tokens the oracle accepted.")
    acceptance_rate: float = Field(0.0, description="accepted / drafted.")
    regime: str | None = Field(None, description="How the request samples, as the length policy keeps its "
                                                 "acceptance estimates apart (\"greedy\", \"temperature 0.85-1.15\", ...).")
    idle_steps: int = Field(0, description="Steps that could have drafted and did not: the policy judged drafting "
                                           "not worth it, or plain batched decoding measured faster.")
    idle_reason: str | None = Field(None, description="Why, when there were idle steps: the policy's estimate "
                                                      "against its threshold, and/or the batch's measured rates.")
    sources: dict[str, SourceCounts] | None = Field(
        None, description="Draft tokens proposed and accepted by where they came from: \"model\" (the draft "
                          "model), \"lookup\" (prompt lookup: the request's own text), \"suffix\" (the suffix "
                          "cache: earlier requests' text of the same API key).")


class TopLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(None, description="The token's own UTF-8 bytes (a token may hold part of a "
                                                      "character, which `token` then shows as U+FFFD).")


class LogprobEntry(TopLogprobEntry):
    top_logprobs: list[TopLogprobEntry] = []


class ChoiceLogprobs(BaseModel):
    content: list[LogprobEntry] | None = None
    refusal: list[LogprobEntry] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments, as JSON text.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None

    _drop_no_calls = _left_out_when_none("tool_calls")


class ReplyFigures(BaseModel):
    """How speculation went for one choice: the figures `localspec chat`'s /stats shows."""

    completion_tokens: int
    steps: int = Field(description="Oracle verify passes.")
    drafted: int
    accepted: int
    lookup_accepted: int = Field(description="Of the accepted draft tokens, those prompt lookup proposed.")
    suffix_accepted: int = Field(0, description="Of the accepted draft tokens, those the suffix cache proposed "
                                                "(earlier requests' text).")
    acceptance_rate: float | None = Field(description="accepted / drafted (null when nothing was drafted).")
    mean_accepted_length: float = Field(description="Draft tokens accepted per verify pass.")
    tokens_per_second: float = Field(description="After the oracle's evaluation of the prompt.")
    speedup: float | None = Field(description="Estimated speedup over the oracle alone: its one-token pass, fitted "
                                              "to the reply's steps, for every token, over the time drafting and "
                                              "verifying took (null: no estimate).")


class SpeculationReport(BaseModel):
    """Extension, only when the request asks (`"speculative": {"sources": true}`)."""

    sources: list[tuple[str, Literal["draft", "lookup", "suffix", "oracle"]]] = Field(
        default_factory=list, description="The text this choice carries (a chunk's delta, or the whole reply) cut "
        "at its tokens: [piece, source] pairs that add up to it; source: accepted from the draft model (\"draft\"), "
        "accepted from prompt lookup (\"lookup\"), accepted from the suffix cache (\"suffix\": earlier requests' "
        "text), or the oracle's own token (\"oracle\": recovered after a "
        "rejection, or the bonus after a fully accepted draft). A character split over tokens is the one's that "
        "completed it.")
    figures: ReplyFigures | None = Field(None, description="With the choice's last chunk (its finish_reason).")

    _drop_no_figures = _left_out_when_none("figures")


class _Reported(BaseModel):
    """A choice that carries the `speculative` report when the request asked for it, and nothing new otherwise."""

    speculative: SpeculationReport | None = None

    @model_serializer(mode="wrap")
    def _report_if_asked(self, handler):
        d = handler(self)
        report = d.pop("speculative", None)
        if report is not None:
            d["speculative"] = report  # after OpenAI's own fields
        return d


class ChatChoice(_Reported):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class _Reply(BaseModel):
    """What every completion body, a whole reply or a streamed chunk, starts with (OpenAI's order:
    a subclass's `object` keeps its place after `id`)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None = None


class ChatCompletion(_Reply):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    """A streamed message delta: only the fields it carries ({} on the finishing chunk), as OpenAI sends them."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # [{"index", "id", "type", "function": {"name", "arguments"}}]

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Reported):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(_Reply):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for an echoed prompt's first token.")
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(description="Where each token starts in the prompt + completion text, in "
                                               "characters (a token holding part of a character starts where it does).")


class CompletionChoice(_Reported):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(_Reply):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "localspec"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail

