"""`localspec serve`: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

    app.py      the FastAPI app: create_app(engine_or_worker, model_name=..., ...); Server, run_server
    routes.py   the endpoints: a request -> its prompt, each choice's options, its replies
    service.py  the one path every generation takes: jobs -> chunks -> the answer; shutdown
    render.py   OpenAI's response bodies from the engine's chunks
    report.py   the extension "speculative": {"sources": true}: where each token came from
    tools.py    response_format, tools and tool_choice: constraints and tool calls
    schemas.py  OpenAI request bodies (pydantic), and the response bodies re-exported
    responses.py  OpenAI response bodies (pydantic)
    gate.py     what every request goes through first: Host, Origin, the API key, the body
    errors.py   OpenAI-shaped error bodies and the exception handlers
    worker.py   the one thread that owns the engine, and its job queue
    metrics.py  Prometheus metrics (/metrics)
    apidocs.py  the API's docs at /docs
    webui.py    the chat page at / (static/: its HTML, CSS and JavaScript; static/vendor/: its Markdown libraries)

A module imports only modules listed below it.
"""

from localspec.server.app import create_app
from localspec.server.worker import EngineWorker

__all__ = ["create_app", "EngineWorker"]
