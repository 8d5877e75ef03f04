"""``/openapi.json`` with the request body of every route, from the same pydantic models that
validate them, so that client generators and schema-driven fuzzers see what each route takes.

Routes read their bodies themselves (``parse_body``: stricter JSON than FastAPI's, and OpenAI's
error shape), so FastAPI cannot infer the bodies; this adds them to the generated document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def document_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make ``app.openapi()`` describe ``bodies`` (path -> model) as the POST bodies of those routes."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        refs, defs = models_json_schema([(model, "validation") for model in bodies.values()],
                                        ref_template="#/components/schemas/{model}")
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(defs.get("$defs", {}))
        schemas["Error"] = ERROR_SCHEMA
        error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for path, model in bodies.items():
            operation = doc["paths"][path]["post"]
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": refs[(model, "validation")]}}}
            operation["responses"].update({"400": {"description": "Invalid request", **error},
                                           "401": {"description": "Missing or wrong API key", **error}})
        app.openapi_schema = doc
        return doc

    app.openapi = openapi


DOCS_ASSETS = "/docs/assets"


def mount_docs(app: FastAPI) -> None:
    """``/docs``: the Swagger UI over /openapi.json, its scripts and styles served from the package
    (swagger-ui-bundle), so that the page works on a machine with no internet (FastAPI's own page
    loads them from a CDN)."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.responses import HTMLResponse
    from fastapi.staticfiles import StaticFiles
    from swagger_ui_bundle import swagger_ui_path

    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} API",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")
