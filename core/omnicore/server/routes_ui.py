"""The browser playground: static HTML, CSS and JavaScript modules served at ``/`` and ``/ui/<file>``.

The files live in ``omnicore/server/ui`` and ship in the wheel; nothing is built or fetched at run time. The page
talks to the same public API as any client (same origin), so it has no privilege the API does not give. With API
keys set, only ``/`` and the exact asset paths listed here are opened (they carry no data): the page asks for the
key, keeps it in ``sessionStorage`` and sends it as ``Authorization: Bearer`` on every data call. ``--no-ui``
leaves all of it out.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from .errors import ApiError

if TYPE_CHECKING:
    from .app import ServerContext

UI_DIR = Path(__file__).with_name("ui")
_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
#: Every asset by name, read once: a request can only ever name one of these (no path handling at all).
ASSETS: dict[str, str] = {p.name: _TYPES[p.suffix] for p in sorted(UI_DIR.iterdir())
                          if p.is_file() and p.suffix in _TYPES} if UI_DIR.is_dir() else {}
#: The page may load its own files and call its own origin, nothing else (no inline script, no third party).
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' blob: data:; media-src 'self' blob:; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


def _read(name: str) -> bytes:
    return (UI_DIR / name).read_bytes()


@router.get("/")
async def index(request: Request) -> Response:
    """The page; ``<meta name="omnicore-auth">`` tells it whether to ask for a key before any data call."""
    auth = "required" if request.app.state.ctx.auth.enabled else "none"
    html = _read("index.html").replace(b"{{auth}}", auth.encode())
    return Response(html, media_type=ASSETS["index.html"], headers=_HEADERS)


@router.get("/ui/{name}")
async def asset(name: str) -> Response:
    if name not in ASSETS or name == "index.html":
        raise ApiError(404, "route_not_found", f"no playground file {name!r}")
    return Response(_read(name), media_type=ASSETS[name], headers=_HEADERS)


def install(app: FastAPI, ctx: ServerContext) -> None:
    """Serve the playground unless ``--no-ui``, and open exactly its paths when keys are set."""
    if getattr(ctx.settings, "no_ui", False) or "index.html" not in ASSETS:
        return
    app.include_router(router)
    # BearerAuth.protects compares paths with the trailing "/" stripped: "/" is "".
    ctx.auth.open_paths = (*ctx.auth.open_paths, "", *(f"/ui/{n}" for n in ASSETS if n != "index.html"))
