"""`localspec serve`: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

    schemas.py  OpenAI request/response bodies (pydantic)
    worker.py   the one thread that owns the engine, and its job queue
    metrics.py  Prometheus metrics (/metrics)
    app.py      the FastAPI app: create_app(engine_or_worker, model_name=..., ...)
    report.py   the extension "speculative": {"sources": true}: where each token came from
    webui.py    the chat page at / (static/: its HTML, CSS and JavaScript; static/vendor/: its Markdown libraries)
"""

from localspec.server.app import create_app
from localspec.server.worker import EngineWorker

__all__ = ["create_app", "EngineWorker"]
