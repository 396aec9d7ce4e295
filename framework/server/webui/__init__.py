"""The built-in chat web UI (``fw serve --ui-server``): static files beside the API, same origin.

The UI is a static bundle (``static/``, built from ``ui/`` at the repository root by ``make ui``;
no Node.js at run time). ``--ui-server`` makes the one uvicorn server listen on a second socket,
the API port minus one (as candle-vllm does). :class:`WebUIApp` routes each request by the port it
arrived on: on the UI port the API paths (``/v1/...``, ``/health``, ``/metrics``, ...) go to the
very same API app, in-process (same-origin proxying: no CORS, the same API-key check, a closed
browser tab aborts its request), and every other path is a file of the bundle.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from litestar import Litestar
from litestar.static_files import create_static_files_router

#: The committed bundle. ``SOURCE_HASH`` in it is the hash of the sources it was built from.
STATIC_DIR = Path(__file__).resolve().parent / "static"
SOURCE_HASH_FILE = "SOURCE_HASH"

#: Paths served by the API app on the UI port too (what the UI calls, plus the service endpoints).
API_PATHS = ("/v1/", "/health", "/version", "/metrics", "/tokenize", "/detokenize")

#: The page runs only its own scripts and talks only to its own origin: even if a model's reply
#: slipped past the sanitizer, an inline handler such as ``onerror=`` would not run.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'"
)


def ui_port_for(api_port: int) -> int:
    """The UI's port: the API port minus one."""
    return api_port - 1


def is_api_path(path: str) -> bool:
    return path.startswith(API_PATHS[0]) or path in API_PATHS[1:]


def create_static_app(static_dir: Path = STATIC_DIR) -> Litestar:
    """A Litestar app serving the bundle (``/`` is ``index.html``) with the UI's security headers."""
    if not (static_dir / "index.html").is_file():
        raise FileNotFoundError(f"the web UI bundle is missing: no index.html in {static_dir} (run `make ui`)")
    router = create_static_files_router(
        path="/", directories=[static_dir], html_mode=True, name="webui", include_in_schema=False
    )
    return Litestar(route_handlers=[router], openapi_config=None, before_send=[_security_headers])


async def _security_headers(message: dict, scope: dict) -> None:
    """Add the CSP (and no caching of ``index.html``, so a new bundle is picked up at once)."""
    if message["type"] != "http.response.start":
        return
    headers = list(message.get("headers", []))
    headers.append((b"content-security-policy", CONTENT_SECURITY_POLICY.encode()))
    headers.append((b"x-content-type-options", b"nosniff"))
    headers.append((b"referrer-policy", b"no-referrer"))
    if not scope["path"].startswith("/assets/"):
        headers.append((b"cache-control", b"no-cache"))
    message["headers"] = headers


class WebUIApp:
    """ASGI app in front of the API app: requests on ``ui_port`` get the UI (API paths still go to the API).

    Lifespan events and requests on any other port go to ``api_app`` untouched.
    """

    def __init__(self, api_app: Any, ui_port: int, static_dir: Path = STATIC_DIR) -> None:
        self.api_app = api_app
        self.ui_port = ui_port
        self.static_app = create_static_app(static_dir)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (
            scope["type"] in ("http", "websocket")
            and _local_port(scope) == self.ui_port
            and not is_api_path(scope["path"])
        ):
            await self.static_app(scope, receive, send)
        else:
            await self.api_app(scope, receive, send)


def _local_port(scope: dict) -> int | None:
    server = scope.get("server")
    return server[1] if server else None


def source_files(ui_dir: Path) -> Iterator[Path]:
    """The files the bundle is built from: everything under ``ui/`` except ``node_modules``, sorted."""
    paths = [
        p for p in ui_dir.rglob("*") if p.is_file() and p.relative_to(ui_dir).parts[0] not in ("node_modules", "dist")
    ]
    yield from sorted(paths, key=lambda p: p.relative_to(ui_dir).as_posix())


def source_hash(ui_dir: Path) -> str:
    """sha256 over each source file's relative POSIX path, a NUL, its bytes and a NUL.

    ``ui/scripts/stamp.mjs`` computes the same hash at build time; the test compares the two.
    """
    digest = hashlib.sha256()
    for path in source_files(ui_dir):
        digest.update(path.relative_to(ui_dir).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()
