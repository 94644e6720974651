"""The FastAPI app: OpenAI's /v1/chat/completions, /v1/completions and /v1/models over one engine
worker, plus /health, /metrics, the OpenAPI docs (/docs, /openapi.json) and a chat page at /
(webui.py). What every request
goes through first (Host, Origin, CORS, the API key, the body) is in gate.py; the error bodies in
errors.py."""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import json
import logging
import math
import os
import secrets
import signal
import time
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Iterable, Iterator

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from localspec import __version__
from localspec.outputs import Chunk, Stats, TokenLogprob
from localspec.runtime.sequence import PromptTooLongError
from localspec.server import report as R
from localspec.server import schemas as S
from localspec.server import tools as T
from localspec.server.errors import (SERVER_ERROR, APIError, on_api_error, on_http_error, on_internal_error, on_validation_error,
                     shutting_down)
from localspec.server.gate import DEFAULT_BODY_TIMEOUT, Gate, Guard, HostRule, OriginRule
from localspec.server.apidocs import router as apidocs_router
from localspec.server.webui import router as webui_router
from localspec.server.worker import CANCELLED, DEFAULT_MAX_QUEUE, STARTED, EngineWorker, Failed, Job, QueueFull, WorkerClosed

log = logging.getLogger("localspec.server")

DEFAULT_MAX_BODY = 4 * 1024 * 1024
DEFAULT_TIME_LIMIT = 600.0  # seconds one generation may run (the openai client gives up at 600 s anyway)
GRACEFUL_SHUTDOWN = 5.0  # seconds the running generation gets after SIGINT/SIGTERM
_SERVER_ERROR = SERVER_ERROR
_MIN_LOGPROB = -9999.0  # JSON has no -inf



# ---------------------------------------------------------------- conversions


def _usage(stats: Stats) -> S.Usage:
    return S.Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.completion_tokens,
                   total_tokens=stats.prompt_tokens + stats.completion_tokens,
                   prompt_tokens_details=S.PromptTokensDetails(
                       cached_tokens=max(0, stats.prompt_tokens - stats.prompt_tokens_evaluated)),
                   steps=stats.steps, drafted=stats.drafted, accepted=stats.accepted,
                   acceptance_rate=round(stats.acceptance_rate, 4), regime=stats.regime or None,
                   idle_steps=stats.idle_steps, idle_reason=stats.idle_reason)


def _merged_usage(stats: list[Stats], prompts: list[Any]) -> S.Usage:
    """One request's usage over its choices: each distinct prompt's tokens once (n choices of one
    prompt read it once, as OpenAI counts), every choice's completion and speculation."""
    total = Stats()
    seen: list[Any] = []
    for s, prompt in zip(stats, prompts):
        if prompt not in seen:
            seen.append(prompt)
            total.prompt_tokens += s.prompt_tokens
            total.prompt_tokens_evaluated += s.prompt_tokens_evaluated
        for name in ("completion_tokens", "steps", "drafted", "accepted", "idle_steps"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
    total.regime = stats[0].regime
    total.idle_reason = next((s.idle_reason for s in stats if s.idle_reason), None)
    return _usage(total)


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


def _completion_logprobs(logprobs: list[TokenLogprob], offsets: _TextOffsets, top_n: int) -> S.CompletionLogprobs:
    """OpenAI's legacy shape; an echoed prompt's first token has null logprobs (nothing predicts it)."""
    return S.CompletionLogprobs(
        tokens=[lp.text for lp in logprobs],
        token_logprobs=[None if lp.logprob is None else _lp(lp.logprob) for lp in logprobs],
        top_logprobs=[None if lp.logprob is None else {t.text: _lp(t.logprob) for t in lp.top} for lp in logprobs]
        if top_n > 0 else None,
        text_offset=[offsets.advance(lp.bytes) for lp in logprobs])


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class _JobStream(StreamingResponse):
    """A streaming response that cancels its jobs (one per choice) however the response ends
    (finished, client gone, server shutting down): the engine stops them within one pass."""

    def __init__(self, jobs: list[Job], content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.jobs = jobs

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def send_tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await super().__call__(scope, receive, send_tracked)
        except asyncio.CancelledError:
            # uvicorn cancels what is still streaming when its graceful shutdown ends (a step slower
            # than the grace period): close the stream with an error event and [DONE] rather than
            # leave a traceback in the log
            for job in self.jobs:
                job.cancel(SHUTDOWN_REASON)
            if not started:
                raise
            tail = _sse(json.dumps(shutting_down().body())) + "data: [DONE]\n\n"
            try:
                await send({"type": "http.response.body", "body": tail.encode(), "more_body": False})
            except Exception:  # the connection is gone too
                pass
        finally:
            for job in self.jobs:
                job.cancel()


async def _watch_disconnect(receive, job: Job) -> None:
    """Cancel `job` when the client disconnects (while it is queued, or a non-streaming request runs)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


SHUTDOWN_REASON = "the server is shutting down"
_SHUTDOWN = object()  # put on a queued request's event queue when the server starts shutting down


# ---------------------------------------------------------------- one request's reply


class _Reply:
    """How one endpoint answers one request: its id, the JSON payloads of a stream's server-sent
    events (`head` before the first chunk, `events` per chunk, `tail` after the last) and the whole
    (non-streamed) response."""

    endpoint = ""  # what the log calls it
    prefix = ""  # of the id

    def __init__(self, model_name: str, stream_options: S.StreamOptions | None, index: int = 0,
                 first: "_Reply | None" = None) -> None:
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


class _ChatReply(_Reply):
    endpoint, prefix = "chat", "chatcmpl"

    def __init__(self, model_name: str, body: S.ChatCompletionRequest, plan: T.ToolPlan | None, index: int = 0,
                 first: _Reply | None = None) -> None:
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
            if calls is not None and calls.sent and event.structure == "complete":
                finish = "tool_calls"
            elif calls is not None and calls.unsent():  # cut inside a call: its text, as content
                yield self._delta(S.Delta(content=calls.unsent()))
            yield self._delta(S.Delta(), finish=finish, report=R.last(event, text=False) if self.report else None)

    def choice(self, text: str, logprobs: list[TokenLogprob], final: Chunk) -> S.ChatChoice:
        calls = T.parse_tool_calls(text) if self.plan is not None and final.structure == "complete" else None
        message = S.AssistantMessage(content=text) if not calls else S.AssistantMessage(tool_calls=calls)
        return S.ChatChoice(index=self.index, message=message, finish_reason="tool_calls" if calls else final.finish_reason,
                            logprobs=_chat_logprobs(logprobs) if self.body.logprobs and not calls else None,
                            speculative=R.last(final, text=not calls) if self.report else None)

    def whole(self, choices: list, usage: S.Usage) -> S.ChatCompletion:
        return S.ChatCompletion(id=self.rid, created=self.created, model=self.model, usage=usage, choices=choices)


class _CompletionReply(_Reply):
    endpoint, prefix = "completion", "cmpl"

    def __init__(self, model_name: str, body: S.CompletionRequest, prompt: str, index: int = 0,
                 first: _Reply | None = None) -> None:
        """`prompt`: the prompt's text (token ids detokenized)."""
        super().__init__(model_name, body.stream_options, index, first)
        self.logprobs, self.top_n = body.logprobs, body.logprobs or 0
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
                lp = _completion_logprobs(event.prompt_logprobs, self.offsets, self.top_n)
            yield self.chunk(self._choice(self.echo, None, lp)).model_dump_json(exclude=self.exclude)
            self.echo = None
        lp = None
        if event.logprobs is not None and self.logprobs is not None:
            lp = _completion_logprobs(event.logprobs, self.offsets, self.top_n)
        if event.text or lp or event.finish_reason:
            yield self.chunk(self._choice(event.text, event.finish_reason, lp, self._report(event))).model_dump_json(
                exclude=self.exclude)

    def choice(self, text: str, logprobs: list[TokenLogprob], final: Chunk) -> S.CompletionChoice:
        """`logprobs`: the prompt's first when echoed (collect puts them in front)."""
        lp = _completion_logprobs(logprobs, self.offsets, self.top_n) if self.logprobs is not None else None
        return self._choice((self.echo or "") + text, final.finish_reason, lp, self._report(final))[0]

    def whole(self, choices: list, usage: S.Usage) -> S.Completion:
        return self.chunk(choices, usage=usage)


# ---------------------------------------------------------------- the service


class _Service:
    """What the routes share: the worker, the names the server answers to, the requests queued and
    running, and the one path every generation takes: start the job -> stream or collect its chunks
    -> render them (`respond`)."""

    def __init__(self, worker: EngineWorker, *, owns_worker: bool, model_name: str, aliases: Iterable[str],
                 max_tokens_limit: int, time_limit: float | None, log_prompts: bool) -> None:
        self.worker, self.owns_worker = worker, owns_worker
        self.model_name = model_name
        self.names = {model_name, *aliases}
        self.max_tokens_limit = max_tokens_limit
        self.time_limit = time_limit
        self.log_prompts = log_prompts
        self.started = int(time.time())
        self.waiting: dict[Job, asyncio.Queue] = {}  # submitted, not yet started by the engine
        self.running: set[Job] = set()  # started, response not finished
        self.draining = False

    def begin_shutdown(self, grace: float) -> None:
        """The server stops (SIGTERM/SIGINT): queued requests get a 503 now, new ones too; the
        running generation has `grace` seconds to finish, then ends with an error body (a 503, or
        an error event and [DONE] on a stream). Called on the event loop."""
        if self.draining:
            return
        self.draining = True
        if self.waiting or self.running:
            log.info("shutting down: %d queued request(s) refused, %d running get %g s", len(self.waiting),
                     len(self.running), grace)
        for events in list(self.waiting.values()):
            events.put_nowait(_SHUTDOWN)

        def stop_running() -> None:
            for job in list(self.running):
                job.cancel(SHUTDOWN_REASON)

        asyncio.get_running_loop().call_later(grace, stop_running)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise APIError(404, f"The model '{model}' does not exist (this server serves '{self.model_name}').",
                           param="model", code="model_not_found")

    def structured(self, body: S.ChatCompletionRequest, messages: list, options: dict) -> tuple[list, T.ToolPlan | None]:
        """response_format and tools: the constraint in `options`, the messages to render (tools in
        the template that takes them, else in a generic system message)."""
        text = T.response_format_constraint(body.response_format)
        grammar = T.grammar_constraint(body.grammar)
        if grammar is not None:
            if text is not None:
                raise S.InvalidParam("grammar: give grammar or response_format, not both", "grammar")
            text = grammar
        plan = T.plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, text)
        if plan is not None and grammar is not None:
            raise S.InvalidParam("grammar: not supported together with tools (response_format is)", "grammar")
        if plan is not None:
            options["grammar"] = T.tool_grammar(plan)
        elif text is not None:
            options["grammar"] = text
        template = getattr(self.worker.engine.oracle_model, "chat_template", None)
        if T.template_takes_tools(template):
            if plan is not None:
                options["tools"] = [t.spec for t in plan.tools]
            return T.template_messages(messages), plan
        return T.generic_messages(messages, plan), plan

    async def respond(self, request: Request, replies: list[_Reply], prompts: list[Any], options: list[dict[str, Any]],
                      stream: bool) -> Response:
        """Run the generations (one per choice, generated together) and answer with them:
        server-sent events as they go, or the whole response at the end (499 when the client went
        away before it)."""
        started = await self._start_all(request, prompts, options, replies[0].rid)
        jobs = [job for job, _ in started]
        if stream:
            return _JobStream(jobs, self._stream(started, replies, prompts))
        collected = await asyncio.gather(*(self.collect(job, events, request) for job, events in started))
        if any(c is None for c in collected):
            for job in jobs:
                job.cancel()
            return Response(status_code=499)
        for reply, job, (text, _, _) in zip(replies, jobs, collected):
            self.log_done(reply.rid, reply.endpoint, job, text)
        choices = [reply.choice(text, logprobs, final) for reply, (text, logprobs, final) in zip(replies, collected)]
        usage = _merged_usage([final.stats for _, _, final in collected], prompts)
        return JSONResponse(replies[0].whole(choices, usage).model_dump(mode="json"))

    async def _start_all(self, request: Request, prompts: list[Any], options: list[dict[str, Any]],
                         rid: str) -> list[tuple[Job, asyncio.Queue]]:
        """Start every choice's job; a failure to start one cancels the others."""
        tasks = [asyncio.ensure_future(self.start(request, p, o, rid)) for p, o in zip(prompts, options)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result()[0].cancel()
            raise

    async def _stream(self, started: list[tuple[Job, asyncio.Queue]], replies: list[_Reply],
                      prompts: list[Any]) -> AsyncIterator[str]:
        """Every choice's events, interleaved as they come; the usage (if asked) after the last."""
        texts: list[list[str] | None] = [[] if self.log_prompts else None for _ in replies]
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, job: Job, events: asyncio.Queue) -> None:
            async for event in self.chunks(job, events, None):
                await merged.put((i, event))
            await merged.put((i, None))

        for reply in replies:
            for payload in reply.head():
                yield _sse(payload)
        pumps = [asyncio.ensure_future(pump(i, job, events)) for i, (job, events) in enumerate(started)]
        finals: list[Chunk | None] = [None] * len(replies)
        open_choices, failed = len(replies), False
        try:
            while open_choices:
                i, event = await merged.get()
                if event is None:
                    open_choices -= 1
                    continue
                if isinstance(event, Failed):
                    yield _sse(_stream_error(event))
                    failed = True
                    break
                if texts[i] is not None:
                    texts[i].append(event.text)
                for payload in replies[i].events(event):
                    yield _sse(payload)
                if event.finish_reason is not None:
                    finals[i] = event
            if not failed and all(f is not None for f in finals):
                for payload in replies[0].tail(_merged_usage([f.stats for f in finals], prompts)):
                    yield _sse(payload)
        finally:
            for task in pumps:
                task.cancel()
        yield "data: [DONE]\n\n"
        for reply, (job, _), text in zip(replies, started, texts):
            self.log_done(reply.rid, reply.endpoint, job, None if text is None else "".join(text))

    async def start(self, request: Request, prompt: Any, options: dict[str, Any], rid: str) -> tuple[Job, asyncio.Queue]:
        """Queue the job and wait until the engine has accepted it (errors are still HTTP errors here)."""
        if self.draining:
            raise shutting_down()
        worker = self.worker
        try:
            job, events = worker.submit_async(prompt, options, time_limit=self.time_limit)
        except QueueFull as e:
            raise APIError(429, f"The server is busy ({worker.max_queue} requests queued); retry later.",
                           code="rate_limit_exceeded", headers={"Retry-After": str(e.retry_after)}) from None
        except WorkerClosed:
            raise shutting_down() from None
        if self.log_prompts:
            log.info("%s prompt: %r", rid, prompt)
        self.waiting[job] = events
        watcher = asyncio.create_task(_watch_disconnect(request.receive, job))
        try:
            event = await events.get()
        except BaseException:
            job.cancel()
            raise
        finally:
            watcher.cancel()
            self.waiting.pop(job, None)
        if event is _SHUTDOWN:
            job.cancel(SHUTDOWN_REASON)
            raise shutting_down()
        if isinstance(event, Failed):
            if event.client_error:
                param = "messages" if isinstance(prompt, list) else "prompt"
                code = "context_length_exceeded" if isinstance(event.error, PromptTooLongError) else "invalid_value"
                raise APIError(400, str(event.error), param=param, code=code)
            if isinstance(event.error, WorkerClosed):
                raise shutting_down()
            raise APIError(500, _SERVER_ERROR)
        if event is CANCELLED:  # the client went away while queued; nobody reads this
            raise APIError(499, "The request was cancelled.", code="cancelled")
        assert event is STARTED, event
        self.running.add(job)
        return job, events

    async def chunks(self, job: Job, events: asyncio.Queue, request: Request | None) -> AsyncIterator[Chunk | Failed]:
        """The job's chunks until the last one (or a failure). With `request`, a disconnect cancels the job.
        A generation stopped because the server is shutting down ends with a Failed(WorkerClosed)."""
        watcher = asyncio.create_task(_watch_disconnect(request.receive, job)) if request is not None else None
        try:
            while True:
                event = await events.get()
                if event is _SHUTDOWN:  # meant for start(): this one runs on
                    continue
                if event is CANCELLED:
                    if job.cancel_reason == SHUTDOWN_REASON:
                        yield Failed(WorkerClosed(SHUTDOWN_REASON), client_error=False)
                    return
                yield event
                if isinstance(event, Failed) or event.finish_reason is not None:
                    return
        finally:
            self.running.discard(job)
            if watcher is not None:
                watcher.cancel()
            job.cancel()  # no-op once finished

    async def collect(self, job: Job, events: asyncio.Queue, request: Request) -> tuple[str, list, Chunk] | None:
        """A whole (non-streamed) generation: its text, logprobs and last chunk; None when the
        client went away before the end (nobody reads the answer)."""
        parts, logprobs, sources, final = [], [], [], None
        try:
            async for event in self.chunks(job, events, request):
                if isinstance(event, Failed):
                    raise shutting_down() if isinstance(event.error, WorkerClosed) else APIError(500, _SERVER_ERROR)
                parts.append(event.text)
                logprobs.extend(event.prompt_logprobs or ())  # asked for by an echo, on the first chunk
                logprobs.extend(event.logprobs or ())
                sources.extend(event.sources or ())
                final = event
        except asyncio.CancelledError:
            if not self.draining:
                raise
            # uvicorn's own shutdown deadline passed first (a very slow step): still answer in JSON
            job.cancel(SHUTDOWN_REASON)
            raise shutting_down() from None
        if final is None or final.finish_reason is None:
            return None
        if final.sources is not None:  # asked for: the last chunk says where all of the text came from
            final = dataclasses.replace(final, sources=sources)
        return "".join(parts), logprobs, final

    def log_done(self, rid: str, endpoint: str, job: Job, text: str | None) -> None:
        s = job.stats
        if s is None:
            log.info("%s %s: %s after %d tokens", rid, endpoint, job.outcome or "stopped", job.tokens)
            return
        log.info("%s %s: %d prompt (%d cached) + %d completion tokens, acceptance %.0f%% (%d/%d), %.2f s",
                 rid, endpoint, s.prompt_tokens, max(0, s.prompt_tokens - s.prompt_tokens_evaluated),
                 s.completion_tokens, 100 * s.acceptance_rate, s.accepted, s.drafted, s.total_time)
        if self.log_prompts and text is not None:
            log.info("%s completion: %r", rid, text)


def _per_choice(options: dict[str, Any], n: int, n_prompts: int = 1) -> list[dict[str, Any]]:
    """Each choice's options: with a seed, choice j of a prompt uses seed + j (each reproducible,
    and the n choices of one prompt differ as n requests with their own seeds would)."""
    seed = options.get("seed")
    return [dict(options, seed=seed + j) if seed is not None else dict(options)
            for _ in range(n_prompts) for j in range(n)]


def _service(request: Request) -> _Service:
    return request.app.state.service


@contextmanager
def _invalid_params() -> Iterator[None]:
    """A request's unsupported or invalid field is a 400 naming it."""
    try:
        yield
    except S.InvalidParam as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from None


def _options(svc: _Service, body: S.ChatCompletionRequest | S.CompletionRequest) -> dict[str, Any]:
    """The engine options of a request for a model this server serves, with nothing unsupported in it."""
    svc.check_model(body.model)
    model = svc.worker.engine.oracle_model
    body.bias_by_id(lambda text: model.tokenize(text, add_special=False, parse_special=False))
    options = body.engine_options(svc.max_tokens_limit)
    with _invalid_params():
        body.check_supported()
    return options


# ---------------------------------------------------------------- routes

router = APIRouter()
_ERRORS = {code: {"model": S.ErrorResponse} for code in (400, 401, 404, 413, 429, 500)}


@router.get("/health", tags=["server"])
async def health(request: Request) -> JSONResponse:
    svc = _service(request)
    worker = svc.worker
    body = {"status": "ok" if worker.alive else "unavailable", "model": svc.model_name,
            "busy": worker.busy, "queue_depth": worker.queue_depth, "max_queue": worker.max_queue,
            "completed": worker.completed, "cancelled": worker.cancelled}
    return JSONResponse(body, status_code=200 if worker.alive else 503)


@router.get("/metrics", tags=["server"], response_class=Response)
async def metrics_endpoint(request: Request) -> Response:
    metrics = _service(request).worker.metrics
    return Response(metrics.render(), media_type=metrics.content_type)


@router.get("/v1/models", response_model=S.ModelList, tags=["openai"])
async def list_models(request: Request) -> S.ModelList:
    svc = _service(request)
    return S.ModelList(data=[S.Model(id=svc.model_name, created=svc.started)])


@router.get("/v1/models/{model_id:path}", response_model=S.Model, tags=["openai"],
            responses={404: {"model": S.ErrorResponse}})
async def get_model(model_id: str, request: Request) -> S.Model:
    svc = _service(request)
    svc.check_model(model_id)
    return S.Model(id=svc.model_name, created=svc.started)


@router.post("/v1/chat/completions", response_model=S.ChatCompletion, tags=["openai"], responses=_ERRORS)
async def chat_completions(body: S.ChatCompletionRequest, request: Request):
    """Chat completion; `stream: true` answers with server-sent `chat.completion.chunk`s."""
    svc = _service(request)
    options = _options(svc, body)
    with _invalid_params():
        prompt, plan = svc.structured(body, body.engine_messages(), options)
    first = _ChatReply(svc.model_name, body, plan)
    replies = [first] + [_ChatReply(svc.model_name, body, plan, i, first) for i in range(1, body.n)]
    return await svc.respond(request, replies, [prompt] * body.n, _per_choice(options, body.n), body.stream)


@router.post("/v1/completions", response_model=S.Completion, tags=["openai"], responses=_ERRORS)
async def completions(body: S.CompletionRequest, request: Request):
    """Text completion of a raw prompt (no chat template); `stream: true` for server-sent events."""
    svc = _service(request)
    options = _options(svc, body)
    with _invalid_params():
        grammar = T.grammar_constraint(body.grammar)
    if grammar is not None:
        options["grammar"] = grammar
    prompts = [p for p in body.prompts() for _ in range(body.n)]  # choice i: prompt i // n
    texts = [p if isinstance(p, str) else _prompt_text(svc, p) for p in prompts]
    first = _CompletionReply(svc.model_name, body, texts[0])
    replies = [first] + [_CompletionReply(svc.model_name, body, t, i, first) for i, t in enumerate(texts) if i]
    return await svc.respond(request, replies, prompts, _per_choice(options, body.n, len(body.prompts())), body.stream)


def _prompt_text(svc: _Service, tokens: list[int]) -> str:
    """A token-id prompt's text (for echo and the logprobs' text offsets); ids the engine refuses
    (outside the vocabulary) are a 400."""
    engine = svc.worker.engine
    try:
        engine.tokenize_prompt(tokens)
    except ValueError as e:
        raise APIError(400, f"prompt: {e}", param="prompt", code="invalid_value") from None
    return b"".join(engine.oracle_model.token_piece(t, special=True) for t in tokens).decode(errors="replace")


# ---------------------------------------------------------------- the app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    svc: _Service = app.state.service
    log.info("serving %s (n_ctx %d, max queue %d, max_tokens limit %d)", svc.model_name, svc.worker.engine.n_ctx,
             svc.worker.max_queue, svc.max_tokens_limit)
    try:
        yield
    finally:
        if svc.owns_worker:
            await asyncio.to_thread(svc.worker.close)


def create_app(engine_or_worker, *, model_name: str, aliases: Iterable[str] = (), api_key: str | None = None,
               max_queue: int | None = None, max_body: int = DEFAULT_MAX_BODY, log_prompts: bool = False,
               max_tokens_limit: int | None = None, time_limit: float | None = DEFAULT_TIME_LIMIT,
               host: str = "127.0.0.1", allowed_hosts: Iterable[str] = (), cors_origins: Iterable[str] = (),
               body_timeout: float = DEFAULT_BODY_TIMEOUT, webui: bool = True) -> FastAPI:
    """An OpenAI-compatible app over an Engine (the app then owns a worker for it, stopped at
    shutdown) or an EngineWorker (the caller owns it). `model_name` is what /v1/models lists;
    requests may also name any of `aliases` (e.g. the oracle's registry name).

    `max_tokens_limit` (default: half the context) caps every request's max_tokens (larger values
    are clamped; chat without max_tokens gets it); `time_limit` (seconds, None: none) ends a
    generation that runs longer with finish_reason "length". `host` is the address the server is
    bound to: with `allowed_hosts` it decides which Host headers are answered; `cors_origins` are
    the web origins allowed to call it (besides its own pages). `body_timeout`: seconds a request
    body may take to arrive. `webui`: serve the chat page at / (server/webui.py)."""
    if isinstance(engine_or_worker, EngineWorker):
        worker, owns_worker = engine_or_worker, False
        if max_queue is not None:
            worker.max_queue = max_queue
    else:
        worker = EngineWorker(engine_or_worker, max_queue=DEFAULT_MAX_QUEUE if max_queue is None else max_queue)
        owns_worker = True
    metrics = worker.metrics
    if max_tokens_limit is None:
        max_tokens_limit = max(1, worker.engine.n_ctx // 2)
    if max_tokens_limit < 1:
        raise ValueError("max_tokens_limit must be >= 1")
    if time_limit is not None and time_limit <= 0:
        time_limit = None
    service = _Service(worker, owns_worker=owns_worker, model_name=model_name, aliases=aliases,
                       max_tokens_limit=max_tokens_limit, time_limit=time_limit, log_prompts=log_prompts)

    app = FastAPI(
        title="localspec", version=__version__, lifespan=_lifespan, docs_url=None, redoc_url=None,  # apidocs.py
        description="OpenAI-compatible API over localspec's speculative-decoding engine. "
                    "Extension: `\"speculative\": {\"enabled\": false, \"draft_max\": 6, \"sources\": true}` per "
                    "request (`sources`: each choice says where its tokens came from, and its figures); "
                    "`usage` also reports drafted/accepted tokens and the acceptance rate. A chat page is at /.")
    app.state.service = service
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.max_tokens_limit = max_tokens_limit
    app.state.begin_shutdown = service.begin_shutdown

    def methods_for(path: str) -> set[str]:
        out: set[str] = set()
        for route in (*app.routes, *router.routes):  # FastAPI keeps an included router's routes apart
            regex, methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
            if regex is not None and methods and regex.match(path):
                out |= set(methods)
        return out

    # add_middleware: the last added runs first (Guard, then CORS, then Gate)
    app.add_middleware(Gate, api_key=api_key, max_body=max_body, body_timeout=body_timeout, methods_for=methods_for)
    app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"], allow_headers=["*"],
                       expose_headers=["Retry-After"])
    app.add_middleware(Guard, metrics=metrics, hosts=HostRule(host, allowed_hosts), origins=OriginRule(cors_origins))
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(Exception, on_internal_error)
    app.include_router(router)
    app.include_router(apidocs_router)
    if webui:
        app.include_router(webui_router)
    return app


# ---------------------------------------------------------------- running it (localspec serve)


def served_names(pair: str | None, oracle: str | None, model_name: str | None) -> tuple[str, list[str]]:
    """The name the server answers to (--model-name, else the pair's name, else the oracle's) and
    its aliases (the oracle's registry name, or its file name without .gguf)."""
    from localspec.models import Registry

    choice = Registry.load().choose(pair, oracle)
    oracle_name = choice.oracle
    if oracle_name.endswith(".gguf") or "/" in oracle_name or os.sep in oracle_name:
        oracle_name = Path(oracle_name).stem
    name = model_name or (oracle_name if oracle else choice.pair.name)
    return name, [oracle_name]


class Server(uvicorn.Server):
    """uvicorn for an app made by create_app, whose shutdown (SIGINT/SIGTERM, or `should_exit`)
    tells the app at once: queued requests get 503 right away and the running generation gets
    `grace` seconds, then an error body. uvicorn's own deadline comes a few seconds later, for the
    last bytes to go out."""

    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 8080, grace: float = GRACEFUL_SHUTDOWN,
                 log_level: str = "info") -> None:
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                        timeout_graceful_shutdown=int(math.ceil(grace)) + 5))
        self.grace = grace

    async def shutdown(self, sockets=None) -> None:
        begin = getattr(getattr(self.config.app, "state", None), "begin_shutdown", None)
        if begin is not None:
            begin(self.grace)
        await super().shutdown(sockets)


def run_server(engine, *, host: str = "127.0.0.1", port: int = 8080, grace: float = GRACEFUL_SHUTDOWN,
               **app_options) -> None:
    """Serve `engine` until SIGINT/SIGTERM: queued requests then get 503 at once, the running one
    `grace` seconds to finish; the worker thread is joined before this returns."""
    app = create_app(engine, host=host, **app_options)
    logging.getLogger("localspec.server").setLevel(logging.INFO)
    server = Server(app, host=host, port=port, grace=grace)

    def leave(signum, frame):  # uvicorn re-raises the signal that stopped it once it has shut down
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, leave)
    try:
        server.run()
    except KeyboardInterrupt:  # SIGINT, re-raised the same way
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stream_error(event: Failed) -> str:
    """An error after the response started: a `data: {"error": ...}` event (the openai client raises it)."""
    if isinstance(event.error, WorkerClosed):
        return json.dumps(shutting_down().body())
    return json.dumps(APIError(500, _SERVER_ERROR).body())


