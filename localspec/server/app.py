"""The FastAPI app: OpenAI's /v1/chat/completions, /v1/completions and /v1/models over one engine
worker, plus /health, /metrics, the OpenAPI docs (/docs, /openapi.json) and a chat page at /
(webui.py); and `localspec serve`'s uvicorn server that runs it.

The server's modules, each importing only those below it:

    app.py      the app factory (create_app) and the uvicorn server (Server, run_server)
    routes.py   the endpoints: a request -> its prompt, options and replies
    service.py  the one path every generation takes: jobs -> chunks -> the answer; shutdown
    render.py   OpenAI's response bodies from the engine's chunks
    report.py, tools.py, schemas.py, responses.py, gate.py, errors.py, worker.py, metrics.py

What every request goes through first (Host, Origin, CORS, the API key, the body) is in gate.py;
the error bodies in errors.py."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Iterable, Sequence

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from localspec import __version__
from localspec.server.apidocs import router as apidocs_router
from localspec.server.errors import APIError, on_api_error, on_http_error, on_internal_error, on_validation_error
from localspec.server.gate import DEFAULT_BODY_TIMEOUT, Gate, Guard, HostRule, OriginRule
from localspec.server.routes import router
from localspec.server.service import Service
from localspec.server.webui import router as webui_router
from localspec.server.worker import DEFAULT_MAX_QUEUE, EngineWorker

log = logging.getLogger("localspec.server")

DEFAULT_MAX_BODY = 4 * 1024 * 1024
DEFAULT_TIME_LIMIT = 600.0  # seconds one generation may run (the openai client gives up at 600 s anyway)
GRACEFUL_SHUTDOWN = 5.0  # seconds the running generation gets after SIGINT/SIGTERM


# ---------------------------------------------------------------- the app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    svc: Service = app.state.service
    log.info("serving %s (n_ctx %d, max queue %d, max_tokens limit %d)", svc.model_name, svc.worker.engine.n_ctx,
             svc.worker.max_queue, svc.max_tokens_limit)
    try:
        yield
    finally:
        if svc.owns_worker:
            await asyncio.to_thread(svc.worker.close)


def create_app(engine_or_worker, *, model_name: str, aliases: Iterable[str] = (),
               api_key: str | Sequence[str] | None = None,
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
    worker, owns_worker = _worker_for(engine_or_worker, max_queue)
    if max_tokens_limit is None:
        max_tokens_limit = max(1, worker.engine.n_ctx // 2)
    if max_tokens_limit < 1:
        raise ValueError("max_tokens_limit must be >= 1")
    if time_limit is not None and time_limit <= 0:
        time_limit = None
    service = Service(worker, owns_worker=owns_worker, model_name=model_name, aliases=aliases,
                      max_tokens_limit=max_tokens_limit, time_limit=time_limit, log_prompts=log_prompts)

    app = FastAPI(
        title="localspec", version=__version__, lifespan=_lifespan, docs_url=None, redoc_url=None,  # apidocs.py
        description="OpenAI-compatible API over localspec's speculative-decoding engine. "
                    "Extension: `\"speculative\": {\"enabled\": false, \"draft_max\": 6, \"sources\": true}` per "
                    "request (`sources`: each choice says where its tokens came from, and its figures); "
                    "`usage` also reports drafted/accepted tokens and the acceptance rate. A chat page is at /.")
    app.state.service = service
    app.state.worker = worker
    app.state.metrics = worker.metrics
    app.state.max_tokens_limit = max_tokens_limit
    app.state.begin_shutdown = service.begin_shutdown
    _add_middleware(app, worker.metrics, api_key=api_key, max_body=max_body, body_timeout=body_timeout, host=host,
                    allowed_hosts=allowed_hosts, cors_origins=cors_origins)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(Exception, on_internal_error)
    app.include_router(router)
    app.include_router(apidocs_router)
    if webui:
        app.include_router(webui_router)
    return app


def _worker_for(engine_or_worker, max_queue: int | None) -> tuple[EngineWorker, bool]:
    """The app's worker, and whether the app owns it: the one given, or a new one over the engine given."""
    if isinstance(engine_or_worker, EngineWorker):
        if max_queue is not None:
            engine_or_worker.max_queue = max_queue
        return engine_or_worker, False
    return EngineWorker(engine_or_worker, max_queue=DEFAULT_MAX_QUEUE if max_queue is None else max_queue), True


def _add_middleware(app: FastAPI, metrics, *, api_key: str | Sequence[str] | None, max_body: int,
                    body_timeout: float, host: str, allowed_hosts: Iterable[str], cors_origins: Iterable[str]) -> None:
    """What every request goes through before its route: Guard (Host, Origin), CORS, then Gate (the
    API key, the body)."""

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
