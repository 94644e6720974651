"""The chat page at `/` (`localspec serve --no-webui` leaves it out): HTML, CSS and JavaScript
shipped in the package (static/), nothing built and nothing fetched from anywhere else. Replies
are drawn as Markdown by two libraries shipped beside it (static/vendor/: markdown-it and DOMPurify
from the npm registry, pinned, their licences beside them; README.md there says which versions).

The page is a client like any other: it calls the server's own /v1/chat/completions (asking for
the speculative report, server/report.py) and reads /metrics, under the same Host and Origin
checks (gate.py) and with the API key the person types in. Serving it adds nothing a request
could not already do; its Content-Security-Policy lets it talk to this server only, and no other
site may frame it.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import Response

FILES = {"/": "index.html", "/webui/app.js": "app.js", "/webui/app.css": "app.css"}
VENDOR = {"markdown-it": {"/webui/vendor/markdown-it.js": "markdown-it.umd.min.js"},
          "dompurify": {"/webui/vendor/purify.js": "purify.min.js"}}
_TYPES = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8",
          "png": "image/png"}
_HEADERS = {
    # its own script and style, requests to this server, nothing else; never inside another site's frame
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a newer localspec's page at once
}

router = APIRouter(include_in_schema=False)


def serve_files(router: APIRouter, folder: str, files_by_path: dict[str, str], headers: dict[str, str]) -> None:
    """Add a GET route to `router` for each path -> file of static/`folder` ("" for static/ itself),
    read once from the package and sent with `headers`."""

    @lru_cache(maxsize=None)
    def read(name: str) -> bytes:
        return (files(__package__) / "static" / folder / name).read_bytes()

    def route(name: str):
        async def page() -> Response:
            return Response(read(name), media_type=_TYPES[name.rsplit(".", 1)[1]], headers=headers)

        return page

    for path, name in files_by_path.items():
        router.add_api_route(path, route(name), methods=["GET"], name=f"{folder or 'webui'}-{name}")


serve_files(router, "", FILES, _HEADERS)
for _library, _files in VENDOR.items():
    serve_files(router, f"vendor/{_library}", _files, _HEADERS)
