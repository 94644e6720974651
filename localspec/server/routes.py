"""The server's routes: /health, /metrics, /v1/models, and OpenAI's /v1/chat/completions and
/v1/completions, each turning its request into its prompt, each choice's options and the replies
that render them, for the service (service.py) to run."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from localspec.server import schemas as S
from localspec.server import tools as T
from localspec.server.errors import APIError
from localspec.server.render import ChatReply, CompletionReply
from localspec.server.service import Service


def _per_choice(options: dict[str, Any], n: int, n_prompts: int = 1) -> list[dict[str, Any]]:
    """Each choice's options: with a seed, choice j of a prompt uses seed + j (each reproducible,
    and the n choices of one prompt differ as n requests with their own seeds would)."""
    seed = options.get("seed")
    return [dict(options, seed=seed + j) if seed is not None else dict(options)
            for _ in range(n_prompts) for j in range(n)]


def _service(request: Request) -> Service:
    return request.app.state.service


@contextmanager
def _invalid_params() -> Iterator[None]:
    """A request's unsupported or invalid field is a 400 naming it."""
    try:
        yield
    except S.InvalidParam as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from None


def _options(svc: Service, body: S.ChatCompletionRequest | S.CompletionRequest) -> dict[str, Any]:
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
    first = ChatReply(svc.model_name, body, plan)
    replies = [first] + [ChatReply(svc.model_name, body, plan, i, first) for i in range(1, body.n)]
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
    first = CompletionReply(svc.model_name, body, texts[0])
    replies = [first] + [CompletionReply(svc.model_name, body, t, i, first) for i, t in enumerate(texts) if i]
    return await svc.respond(request, replies, prompts, _per_choice(options, body.n, len(body.prompts())), body.stream)


def _prompt_text(svc: Service, tokens: list[int]) -> str:
    """A token-id prompt's text (for echo and the logprobs' text offsets); ids the engine refuses
    (outside the vocabulary) are a 400."""
    engine = svc.worker.engine
    try:
        engine.tokenize_prompt(tokens)
    except ValueError as e:
        raise APIError(400, f"prompt: {e}", param="prompt", code="invalid_value") from None
    return b"".join(engine.oracle_model.token_piece(t, special=True) for t in tokens).decode(errors="replace")

