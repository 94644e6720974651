"""The server's service: what the routes share (the worker, the names the server answers to, the
requests queued and running) and the one path every generation takes: start its jobs (one per
choice) -> stream or collect their chunks -> render them (render.py) -> answer; and how a
shutdown ends what is queued and running."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Any, AsyncIterator, Iterable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from localspec.options import GenerationOptions, OptionError
from localspec.outputs import Chunk
from localspec.runtime.sequence import PromptTooLongError
from localspec.server.errors import SERVER_ERROR, APIError, shutting_down
from localspec.server.render import Reply, merged_usage, sse
from localspec.server.worker import CANCELLED, STARTED, EngineWorker, Failed, Job, QueueFull, WorkerClosed

log = logging.getLogger("localspec.server")

SHUTDOWN_REASON = "the server is shutting down"
_SHUTDOWN = object()  # put on a queued request's event queue when the server starts shutting down


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
            tail = sse(json.dumps(shutting_down().body())) + "data: [DONE]\n\n"
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


class Service:
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

    async def respond(self, request: Request, replies: list[Reply], prompts: list[Any],
                      options: list[GenerationOptions], stream: bool, *, tools: list | None = None) -> Response:
        """Run the generations (one per choice, generated together: its prompt and its checked
        options; `tools` for a chat template that takes them) and answer with them: server-sent
        events as they go, or the whole response at the end (499 when the client went away before it)."""
        started = await self._start_all(request, prompts, options, replies[0].rid, tools)
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
        usage = merged_usage([final.stats for _, _, final in collected], prompts)
        return JSONResponse(replies[0].whole(choices, usage).model_dump(mode="json"))

    async def _start_all(self, request: Request, prompts: list[Any], options: list[GenerationOptions], rid: str,
                         tools: list | None) -> list[tuple[Job, asyncio.Queue]]:
        """Start every choice's job; a failure to start one cancels the others."""
        tasks = [asyncio.ensure_future(self.start(request, p, o, rid, tools)) for p, o in zip(prompts, options)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result()[0].cancel()
            raise

    async def _stream(self, started: list[tuple[Job, asyncio.Queue]], replies: list[Reply],
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
                yield sse(payload)
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
                    yield sse(stream_error(event))
                    failed = True
                    break
                if texts[i] is not None:
                    texts[i].append(event.text)
                for payload in replies[i].events(event):
                    yield sse(payload)
                if event.finish_reason is not None:
                    finals[i] = event
            if not failed and all(f is not None for f in finals):
                for payload in replies[0].tail(merged_usage([f.stats for f in finals], prompts)):
                    yield sse(payload)
        finally:
            for task in pumps:
                task.cancel()
        yield "data: [DONE]\n\n"
        for reply, (job, _), text in zip(replies, started, texts):
            self.log_done(reply.rid, reply.endpoint, job, None if text is None else "".join(text))

    async def start(self, request: Request, prompt: Any, options: GenerationOptions, rid: str,
                    tools: list | None = None) -> tuple[Job, asyncio.Queue]:
        """Queue the job and wait until the engine has accepted it (errors are still HTTP errors here)."""
        if self.draining:
            raise shutting_down()
        worker = self.worker
        try:
            job, events = worker.submit_async(prompt, options, time_limit=self.time_limit, tools=tools,
                                              pool=getattr(request.state, "pool", ""))
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
                raise rejected(event.error, prompt)
            if isinstance(event.error, WorkerClosed):
                raise shutting_down()
            raise APIError(500, SERVER_ERROR)
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
                    raise shutting_down() if isinstance(event.error, WorkerClosed) else APIError(500, SERVER_ERROR)
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
            log.info("%s %s: %s after %d tokens", rid, endpoint, job.outcome.value if job.outcome else "stopped",
                     job.tokens)
            return
        log.info("%s %s: %d prompt (%d cached) + %d completion tokens, acceptance %.0f%% (%d/%d), %.2f s",
                 rid, endpoint, s.prompt_tokens, max(0, s.prompt_tokens - s.prompt_tokens_evaluated),
                 s.completion_tokens, 100 * s.acceptance_rate, s.accepted, s.drafted, s.total_time)
        if self.log_prompts and text is not None:
            log.info("%s completion: %r", rid, text)


def rejected(error: BaseException, prompt: Any) -> APIError:
    """The 400 of a request the engine refused, naming the field at fault by the error's type: an
    option (a logit_bias token outside the vocabulary), else the prompt (too long for the context:
    context_length_exceeded)."""
    if isinstance(error, OptionError):
        return APIError(400, f"Invalid value for '{error.name}': {error}.", param=error.name, code="invalid_value")
    param = "messages" if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) else "prompt"
    code = "context_length_exceeded" if isinstance(error, PromptTooLongError) else "invalid_value"
    return APIError(400, str(error), param=param, code=code)


def stream_error(event: Failed) -> str:
    """An error after the response started: a `data: {"error": ...}` event (the openai client raises it)."""
    if isinstance(event.error, WorkerClosed):
        return json.dumps(shutting_down().body())
    return json.dumps(APIError(500, SERVER_ERROR).body())

