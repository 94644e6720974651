"""The server's routes: /health, /metrics, /v1/models, and OpenAI's /v1/chat/completions and
/v1/completions, each turning its request into its prompt, each choice's options (one checked
GenerationOptions) and the replies that render them, for the service (service.py) to run."""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from localspec.options import GenerationOptions
from localspec.server import schemas as S
from localspec.server import tools as T
from localspec.server.errors import APIError
from localspec.server.render import ChatReply, CompletionReply
from localspec.server.service import Service


def _service(request: Request) -> Service:
    return request.app.state.service


@contextmanager
def _invalid_params() -> Iterator[None]:
    """A request's unsupported or invalid field is a 400 naming it."""
    try:
        yield
    except S.InvalidParam as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from None


def _checked(svc: Service, body: S.ChatCompletionRequest | S.CompletionRequest) -> None:
    """A request for a model this server serves, with nothing unsupported in it and only valid
    Unicode in its text; its logit_bias by token id."""
    svc.check_model(body.model)
    _no_lone_surrogates(body.model_dump(exclude_unset=True, by_alias=True))
    model = svc.worker.engine.oracle_model
    body.bias_by_id(lambda text: model.tokenize(text, add_special=False, parse_special=False))
    with _invalid_params():
        body.check_supported()


_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_lone_surrogates(value: Any, path: str = "") -> None:
    """A 400 naming the field whose text holds half of a UTF-16 surrogate pair (JSON lets a string
    say "\\ud800" alone; it is no Unicode character, and no tokenizer can take it)."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        if found is not None:
            raise APIError(400, f"{path or 'the request'}: the text holds a lone UTF-16 surrogate "
                                f"(U+{ord(found.group()):04X}) at character {found.start()}, which is not a Unicode "
                                "character: send the pair whole, or the character itself",
                           param=path or None, code="invalid_value")
    elif isinstance(value, dict):
        for key, item in value.items():
            _no_lone_surrogates(key, f"{path}.{key}" if path else str(key))
            _no_lone_surrogates(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _no_lone_surrogates(item, f"{path}[{i}]")


def _per_choice(options: GenerationOptions, n: int, n_prompts: int = 1) -> list[GenerationOptions]:
    """Each choice's options: with a seed, choice j of a prompt uses seed + j (each reproducible,
    and the n choices of one prompt differ as n requests with their own seeds would)."""
    seed = options.seed
    return [replace(options, seed=seed + j) if seed is not None and j else options
            for _ in range(n_prompts) for j in range(n)]


def _structured(svc: Service, body: S.ChatCompletionRequest) -> tuple[list, T.ToolPlan | None, Any, list | None]:
    """response_format, grammar and tools: (the messages to render, the tool plan, the constraint
    of the output, the tools for a chat template that takes them). Tools go in the template that
    takes them, else in a generic system message."""
    messages = body.engine_messages()
    constraint = T.response_format_constraint(body.response_format)
    grammar = T.grammar_constraint(body.grammar)
    if grammar is not None:
        if constraint is not None:
            raise S.InvalidParam("grammar: give grammar or response_format, not both", "grammar")
        constraint = grammar
    plan = T.plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, constraint)
    if plan is not None and grammar is not None:
        raise S.InvalidParam("grammar: not supported together with tools (response_format is)", "grammar")
    if plan is not None:
        constraint = T.tool_grammar(plan)
    template = getattr(svc.worker.engine.oracle_model, "chat_template", None)
    if T.template_takes_tools(template):
        return T.template_messages(messages), plan, constraint, [t.spec for t in plan.tools] if plan else None
    return T.generic_messages(messages, plan), plan, constraint, None


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
    prompt, plan, tools, options = await run_in_threadpool(_prepare_chat, svc, body)
    first = ChatReply(svc.model_name, body, plan)
    replies = [first] + [ChatReply(svc.model_name, body, plan, i, first) for i in range(1, body.n)]
    return await svc.respond(request, replies, [prompt] * body.n, _per_choice(options, body.n), body.stream,
                             tools=tools)


@router.post("/v1/completions", response_model=S.Completion, tags=["openai"], responses=_ERRORS)
async def completions(body: S.CompletionRequest, request: Request):
    """Text completion of a raw prompt (no chat template); `stream: true` for server-sent events."""
    svc = _service(request)
    options, prompts, texts = await run_in_threadpool(_prepare_completion, svc, body)
    first = CompletionReply(svc.model_name, body, texts[0])
    replies = [first] + [CompletionReply(svc.model_name, body, t, i, first) for i, t in enumerate(texts) if i]
    return await svc.respond(request, replies, prompts, _per_choice(options, body.n, len(body.prompts())), body.stream)


def _prepare_chat(svc: Service, body: S.ChatCompletionRequest) -> tuple[list, T.ToolPlan | None, list | None, Any]:
    """A chat request's work before it is queued: its checks (logit_bias's texts tokenized), its
    prompt, tool plan and constraint (a schema or grammar compiled), its options. The routes run it
    (and `_prepare_completion`) in a worker thread, not on the event loop, so one request's cost
    cannot hold up every other client's."""
    _checked(svc, body)
    with _invalid_params():
        prompt, plan, constraint, tools = _structured(svc, body)
        return prompt, plan, tools, body.generation_options(svc.max_tokens_limit, constraint)


def _prepare_completion(svc: Service, body: S.CompletionRequest) -> tuple[Any, list, list[str]]:
    """A completion request's work before it is queued (see `_prepare_chat`): its options, each
    choice's prompt and that prompt's text."""
    _checked(svc, body)
    with _invalid_params():
        options = body.generation_options(svc.max_tokens_limit, T.grammar_constraint(body.grammar))
    prompts = [p for p in body.prompts() for _ in range(body.n)]  # choice i: prompt i // n
    return options, prompts, [p if isinstance(p, str) else _prompt_text(svc, p) for p in prompts]


def _prompt_text(svc: Service, tokens: list[int]) -> str:
    """A token-id prompt's text (for echo and the logprobs' text offsets); ids the engine refuses
    (outside the vocabulary) are a 400."""
    engine = svc.worker.engine
    try:
        engine.tokenize_prompt(tokens)
    except ValueError as e:
        raise APIError(400, f"prompt: {e}", param="prompt", code="invalid_value") from None
    return b"".join(engine.oracle_model.token_piece(t, special=True) for t in tokens).decode(errors="replace")

