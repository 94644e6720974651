"""The API's docs page at /docs: Swagger UI over /openapi.json, its files shipped in the package
(static/apidocs/: swagger-ui-dist from the npm registry, its licence beside it), so the page works
offline and asks nothing of any other site (FastAPI's own /docs loads Swagger UI from a CDN, and
its /redoc ReDoc: both are off)."""

from __future__ import annotations

from fastapi import APIRouter

from localspec.server.webui import serve_files

FILES = {"/docs": "index.html", "/docs/init.js": "init.js", "/docs/swagger-ui-bundle.js": "swagger-ui-bundle.js",
         "/docs/swagger-ui.css": "swagger-ui.css", "/docs/favicon-32x32.png": "favicon-32x32.png"}
_HEADERS = {
    # its own scripts, requests to this server; Swagger UI sets inline styles and draws data: images
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

router = APIRouter(include_in_schema=False)
serve_files(router, "apidocs", FILES, _HEADERS)
