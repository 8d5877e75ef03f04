"""The web console at ``/``: one page and its script and styles, shipped in the package (web/),
served with no third-party assets so that it works offline. The page holds no data: what it
shows it reads from GET /snapshot and the OpenAI API with the key the user types, so the page
and its assets load without a key (server/guard.py). ``--no-web-ui`` leaves ``/`` a 404."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from anna.server.guard import CONSOLE_ASSETS, CONSOLE_PAGE

WEB_DIR = Path(__file__).parent / "web"


def mount_console(app: FastAPI) -> None:
    app.mount(CONSOLE_ASSETS.rstrip("/"), StaticFiles(directory=WEB_DIR), name="console")

    @app.get(CONSOLE_PAGE, include_in_schema=False)
    async def console() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})
