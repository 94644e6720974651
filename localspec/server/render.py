"""How the server renders a generation: OpenAI's response bodies (schemas.py) from the engine's
chunks, one choice at a time (`Reply`: a stream's server-sent events, or the whole response), and
the usage of a request's choices."""

from __future__ import annotations

import codecs
import secrets
import time
from typing import Any, Iterable

from localspec.outputs import Chunk, Stats, Structure, TokenLogprob
from localspec.server import report as R
from localspec.server import schemas as S
from localspec.server import tools as T

_MIN_LOGPROB = -9999.0  # JSON has no -inf


def usage_of(stats: Stats) -> S.Usage:
    """One generation's usage, from its stats."""
    return S.Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.completion_tokens,
                   total_tokens=stats.prompt_tokens + stats.completion_tokens,
                   prompt_tokens_details=S.PromptTokensDetails(
                       cached_tokens=max(0, stats.prompt_tokens - stats.prompt_tokens_evaluated)),
                   steps=stats.steps, drafted=stats.drafted, accepted=stats.accepted,
                   acceptance_rate=round(stats.acceptance_rate, 4), regime=stats.regime or None,
                   idle_steps=stats.idle_steps, idle_reason=stats.idle_reason,
                   sources={source: S.SourceCounts(drafted=d, accepted=a) for source, (d, a) in stats.by_source().items()})


def merged_usage(stats: list[Stats], prompts: list[Any]) -> S.Usage:
    """One request's usage over its choices: each distinct prompt's tokens once (n choices of one
    prompt read it once, as OpenAI counts), every choice's completion and speculation."""
    total = Stats()
    seen: list[Any] = []
    for s, prompt in zip(stats, prompts):
        if prompt not in seen:
            seen.append(prompt)
            total.prompt_tokens += s.prompt_tokens
            total.prompt_tokens_evaluated += s.prompt_tokens_evaluated
        for name in ("completion_tokens", "steps", "drafted", "accepted", "idle_steps", "lookup_drafted",
                     "lookup_accepted", "suffix_drafted", "suffix_accepted"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
    total.regime = stats[0].regime
    total.idle_reason = next((s.idle_reason for s in stats if s.idle_reason), None)
    return usage_of(total)


def _lp(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def _chat_logprobs(logprobs: list[TokenLogprob]) -> S.ChoiceLogprobs:
    """Each token's real bytes (a token may hold part of a UTF-8 character), its rivals' too."""
    return S.ChoiceLogprobs(content=[
        S.LogprobEntry(token=lp.text, logprob=_lp(lp.logprob), bytes=list(lp.bytes),
                       top_logprobs=[S.TopLogprobEntry(token=t.text, logprob=_lp(t.logprob), bytes=list(t.bytes))
                                     for t in lp.top])
        for lp in logprobs])


class _TextOffsets:
    """Where each token starts in the returned text, in characters: the tokens' bytes go through the
    same incremental UTF-8 decoder (errors replaced) that made the text, so a token holding part of a
    character counts no character of its own, and starts where that character does. Carried across
    the chunks of a stream."""

    def __init__(self, start: int) -> None:
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, piece: bytes) -> int:
        at = self.offset
        self.offset += len(self._decoder.decode(piece))
        return at


def _completion_logprobs(logprobs: list[TokenLogprob], offsets: _TextOffsets) -> S.CompletionLogprobs:
    """OpenAI's legacy shape; an echoed prompt's first token has null logprobs (nothing predicts it)."""
    return S.CompletionLogprobs(
        tokens=[lp.text for lp in logprobs],
        token_logprobs=[None if lp.logprob is None else _lp(lp.logprob) for lp in logprobs],
        # OpenAI's reference: the sampled token's own logprob is always among them (up to logprobs + 1)
        top_logprobs=[None if lp.logprob is None else {**{t.text: _lp(t.logprob) for t in lp.top},
                                                        lp.text: _lp(lp.logprob)} for lp in logprobs],
        text_offset=[offsets.advance(lp.bytes) for lp in logprobs])


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"



# ---------------------------------------------------------------- one request's reply


class Reply:
    """How one endpoint answers one request: its id, the JSON payloads of a stream's server-sent
    events (`head` before the first chunk, `events` per chunk, `tail` after the last) and the whole
    (non-streamed) response."""

    endpoint = ""  # what the log calls it
    prefix = ""  # of the id

    def __init__(self, model_name: str, stream_options: S.StreamOptions | None, index: int = 0,
                 first: "Reply | None" = None) -> None:
        """`index`: the choice this reply renders; `first`: the request's choice 0, whose id it shares."""
        self.rid = first.rid if first is not None else f"{self.prefix}-{secrets.token_hex(12)}"
        self.created = first.created if first is not None else int(time.time())
        self.index = index
        self.model = model_name
        self.include_usage = bool(stream_options and stream_options.include_usage)
        self.exclude = None if self.include_usage else {"usage"}  # a chunk's usage is sent on its own

    def chunk(self, choices: list, usage: S.Usage | None = None) -> Any:
        """A streamed chunk (its envelope: id, created, model) holding `choices` or `usage`."""
        raise NotImplementedError

    def head(self) -> Iterable[str]:
        return ()

    def events(self, event: Chunk) -> Iterable[str]:
        raise NotImplementedError

    def tail(self, usage: S.Usage) -> Iterable[str]:
        """After every choice's last chunk."""
        if self.include_usage:
            yield self.chunk([], usage=usage).model_dump_json()

    def choice(self, text: str, logprobs: list[TokenLogprob], final: Chunk) -> Any:
        """This choice in the whole (non-streamed) response."""
        raise NotImplementedError

    def whole(self, choices: list, usage: S.Usage) -> Any:
        """The whole response of every choice."""
        raise NotImplementedError


class ChatReply(Reply):
    endpoint, prefix = "chat", "chatcmpl"

    def __init__(self, model_name: str, body: S.ChatCompletionRequest, plan: T.ToolPlan | None, index: int = 0,
                 first: Reply | None = None) -> None:
        super().__init__(model_name, body.stream_options, index, first)
        self.body, self.plan = body, plan
        self.calls = T.ToolCallStream() if plan is not None else None
        self.report = R.asked(body)  # where each token came from, and the figures: only when asked

    def chunk(self, choices: list, usage: S.Usage | None = None) -> S.ChatCompletionChunk:
        return S.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=choices,
                                     usage=usage)

    def _delta(self, delta: S.Delta, finish=None, logprobs=None, report=None) -> str:
        return self.chunk([S.ChatChunkChoice(index=self.index, delta=delta, finish_reason=finish, logprobs=logprobs,
                                             speculative=report)]).model_dump_json(exclude=self.exclude)

    def head(self) -> Iterable[str]:
        yield self._delta(S.Delta(role="assistant", content=""))

    def events(self, event: Chunk) -> Iterable[str]:
        calls = self.calls
        lp = _chat_logprobs(event.logprobs) if event.logprobs else None
        content, deltas = calls.feed(event.text) if calls is not None else (event.text, [])
        if calls is not None and calls.mode != "text":
            lp = None  # a call's tokens are not content
        if content or lp:  # content: all of the chunk's text (a call's is none of it), as its sources say
            yield self._delta(S.Delta(content=content), logprobs=lp, report=R.sources(event) if self.report else None)
        if deltas:
            yield self._delta(S.Delta(tool_calls=deltas))
        if event.finish_reason is not None:
            finish = event.finish_reason
            if calls is not None and calls.sent and event.structure is Structure.COMPLETE:
                finish = "tool_calls"
            elif calls is not None and calls.unsent():  # cut inside a call: its text, as content
                yield self._delta(S.Delta(content=calls.unsent()))
            yield self._delta(S.Delta(), finish=finish, report=R.last(event, text=False) if self.report else None)

    def choice(self, text: str, logprobs: list[TokenLogprob], final: Chunk) -> S.ChatChoice:
        calls = T.parse_tool_calls(text) if self.plan is not None and final.structure is Structure.COMPLETE else None
        message = S.AssistantMessage(content=text) if not calls else S.AssistantMessage(tool_calls=calls)
        return S.ChatChoice(index=self.index, message=message, finish_reason="tool_calls" if calls else final.finish_reason,
                            logprobs=_chat_logprobs(logprobs) if self.body.logprobs and not calls else None,
                            speculative=R.last(final, text=not calls) if self.report else None)

    def whole(self, choices: list, usage: S.Usage) -> S.ChatCompletion:
        return S.ChatCompletion(id=self.rid, created=self.created, model=self.model, usage=usage, choices=choices)


class CompletionReply(Reply):
    endpoint, prefix = "completion", "cmpl"

    def __init__(self, model_name: str, body: S.CompletionRequest, prompt: str, index: int = 0,
                 first: Reply | None = None) -> None:
        """`prompt`: the prompt's text (token ids detokenized)."""
        super().__init__(model_name, body.stream_options, index, first)
        self.logprobs = body.logprobs
        self.echo = prompt if body.echo else None  # sent in front of the text, once
        self.offsets = _TextOffsets(0 if body.echo else len(prompt))  # where each token starts in the text
        self.report = R.asked(body)  # where each token came from, and the figures: only when asked

    def chunk(self, choices: list, usage: S.Usage | None = None) -> S.Completion:
        return S.Completion(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage)

    def _choice(self, text: str, finish=None, logprobs=None, report=None) -> list[S.CompletionChoice]:
        return [S.CompletionChoice(index=self.index, text=text, finish_reason=finish, logprobs=logprobs,
                                   speculative=report)]

    def _report(self, event: Chunk) -> S.SpeculationReport | None:
        if not self.report:
            return None
        return R.last(event) if event.finish_reason is not None else R.sources(event)

    def events(self, event: Chunk) -> Iterable[str]:
        if self.echo is not None:
            lp = None
            if event.prompt_logprobs is not None and self.logprobs is not None:
                lp = _completion_logprobs(event.prompt_logprobs, self.offsets)
            yield self.chunk(self._choice(self.echo, None, lp)).model_dump_json(exclude=self.exclude)
            self.echo = None
        lp = None
        if event.logprobs is not None and self.logprobs is not None:
            lp = _completion_logprobs(event.logprobs, self.offsets)
        if event.text or lp or event.finish_reason:
            yield self.chunk(self._choice(event.text, event.finish_reason, lp, self._report(event))).model_dump_json(
                exclude=self.exclude)

    def choice(self, text: str, logprobs: list[TokenLogprob], final: Chunk) -> S.CompletionChoice:
        """`logprobs`: the prompt's first when echoed (collect puts them in front)."""
        lp = _completion_logprobs(logprobs, self.offsets) if self.logprobs is not None else None
        return self._choice((self.echo or "") + text, final.finish_reason, lp, self._report(final))[0]

    def whole(self, choices: list, usage: S.Usage) -> S.Completion:
        return self.chunk(choices, usage=usage)

