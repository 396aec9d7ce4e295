"""Run the server: parse the bind address, start uvicorn, print the summary and the ready line.

SIGTERM / Ctrl-C: the server stops accepting, ``/health`` turns 503 (draining), in-flight requests
finish for up to ``shutdown_timeout`` seconds, the rest are cancelled (which aborts them in the
engine), then the engine process is stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import stat
import sys
from types import FrameType
from typing import Any, NamedTuple

import uvicorn

import framework
from framework.engine.messages import Ready
from framework.errors import ConfigError
from framework.server.app import create_app
from framework.server.engine_client import AsyncEngineClient
from framework.server.errors import APIError
from framework.server.state import ServerConfig, ServerState

#: Loopback by default: serving the LAN is one flag away (``--h 0.0.0.0``), and then a key should guard it.
DEFAULT_HOST = "127.0.0.1"


class BindAddress(NamedTuple):
    host: str | None
    port: int | None
    uds: str | None

    @property
    def url(self) -> str:
        if self.uds is not None:
            return f"unix://{self.uds}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def parse_bind(address: str | None, port: int) -> BindAddress:
    """``host``, ``host:port``, ``[ipv6]:port``, bare IPv6, ``tcp://host[:port]``, or ``unix:// | file:// | socket:///path``."""
    address = (address or DEFAULT_HOST).strip()
    for scheme in ("unix://", "file://", "socket://"):
        if address.startswith(scheme):
            path = address[len(scheme) :]
            if not path:
                raise ConfigError(f"--h {address!r}: give a socket path, e.g. unix:///tmp/fw.sock")
            return BindAddress(None, None, path)
    address = address.removeprefix("tcp://").removeprefix("http://").rstrip("/")
    host, port_text = address, None
    if address.startswith("["):
        end = address.find("]")
        if end < 0:
            raise ConfigError(f"--h {address!r}: an IPv6 address in brackets needs the closing ']'")
        host, rest = address[1:end], address[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ConfigError(f"--h {address!r}: expected [ipv6]:port")
            port_text = rest[1:]
    elif address.count(":") == 1:
        host, port_text = address.split(":")
    if port_text is not None:
        if not port_text.isdigit() or not 0 <= int(port_text) < 65536:
            raise ConfigError(f"--h {address!r}: the port must be a number in [0, 65535]")
        port = int(port_text)
    return BindAddress(host or DEFAULT_HOST, port, None)


def weights_line(summary: dict[str, Any]) -> str:
    """``"4.60 GiB (file 4.58 GiB)"``: the memory the weights take on the (first) device, beside
    the size of the checkpoint's files when they came from files."""
    text = f"{summary.get('weight_bytes', 0) / 2**30:.2f} GiB"
    if summary.get("checkpoint_bytes"):
        text += f" (file {summary['checkpoint_bytes'] / 2**30:.2f} GiB)"
    return text


def format_summary(ready: Ready) -> str:
    s = ready.summary
    lines = [
        f"fw {framework.__version__}",
        f"  model      {s.get('model')} ({s.get('architecture')}, {s.get('weight_format')})",
        f"  dtype      {s.get('dtype')} on {s.get('device')}; attention backend {s.get('attention_backend')}",
        f"  context    {ready.max_model_len} tokens",
        f"  weights    {weights_line(s)}",
        *([f"  isq        {s['isq']}"] if s.get("isq") else []),
        *(
            [f"  images     up to {s['vision']['max_images']} per prompt ({s['vision']['image_processor']})"]
            if s.get("vision")
            else [f"  images     none: {s['text_only_reason']}"]
            if s.get("text_only_reason")
            else []
        ),
        f"  KV cache   {s.get('kv_cache_dtype', 'auto')}: {s.get('kv_blocks')} blocks, {s.get('kv_tokens')} tokens, "
        f"{s.get('kv_bytes', 0) / 2**20:.1f} MiB, {s.get('kv_bytes_per_token')} bytes per token",
        f"  plugins    {', '.join(s.get('plugins', []))}",
    ]
    return "\n".join(lines)


def tool_calling_line(state: ServerState) -> str:
    """How tool calls are read for this model (the path, and what its template renders of tools)."""
    try:
        return state.served_parsers().describe()
    except APIError as error:  # a parser plugin that fails to load: the server stays up, chat says why
        return f"unavailable: {error.message}"


class _Server(uvicorn.Server):
    """uvicorn with a draining flag, a ready line once both the socket and the engine are up, and exit 0 on SIGTERM."""

    def __init__(self, config: uvicorn.Config, state: ServerState, url: str, ui_url: str | None = None) -> None:
        super().__init__(config)
        self.state, self.url, self.ui_url = state, url, ui_url
        self.engine_ready = False
        self.announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.state.is_draining = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self.announce()

    def announce(self) -> None:
        if self.started and self.engine_ready and not self.announced and not self.should_exit:
            self.announced = True
            if self.ui_url is not None:
                print(f"fw: web UI at {self.ui_url}", flush=True)
            print(
                f"fw: ready, serving {self.state.model_name!r} at {self.url} (OpenAI API under {self.url}/v1)",
                flush=True,
            )


def exposure_warning(bind: BindAddress, api_keys: list[str]) -> str | None:
    """The start-up warning for a server that listens beyond this machine with no API key (None: no warning)."""
    from framework.server.origins import is_loopback

    if bind.uds is not None or api_keys or is_loopback(bind.host):
        return None
    return (
        f"fw: warning: listening on {bind.url} without an API key: anyone who can reach this address can use "
        "the model; set FW_API_KEY or --api-key-file (or bind 127.0.0.1)"
    )


def unix_socket(path: str) -> socket.socket:
    """A listening unix socket at ``path``, created with mode 0600 (only this user may connect).

    A stale socket file at ``path`` is replaced; any other file there is an error."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ConfigError(f"--h unix://{path}: a file that is not a socket is in the way")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # no window in which the socket is reachable by others
    try:
        sock.bind(path)
    except OSError as error:
        sock.close()
        raise ConfigError(f"cannot listen on unix://{path}: {error.strerror}") from None
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(2048)
    return sock


def bind_sockets(bind: BindAddress, ui_server: bool) -> tuple[list[socket.socket] | None, BindAddress | None]:
    """With ``ui_server``: the API socket and the web UI's socket (API port minus one), and the UI's address.

    Without it: ``(None, None)`` (uvicorn binds the TCP address itself), or the unix socket (mode 0600).
    """
    if not ui_server:
        return ([unix_socket(bind.uds)] if bind.uds is not None else None), None
    from framework.server.webui import ui_port_for

    if bind.uds is not None:
        raise ConfigError(
            "--ui-server serves the web UI on the API port minus one, so it needs a TCP address, "
            f"not the socket {bind.uds!r}"
        )
    if not bind.port or bind.port < 2:
        raise ConfigError(
            f"--ui-server serves the web UI on the API port minus one; give a port >= 2 with --p "
            f"(e.g. --p 2000 for the API and 1999 for the UI), got {bind.port}"
        )
    ui_bind = BindAddress(bind.host, ui_port_for(bind.port), None)
    family = socket.AF_INET6 if ":" in bind.host else socket.AF_INET
    sockets = []
    for address, role in ((bind, "the API"), (ui_bind, "the web UI (--ui-server: API port minus one)")):
        try:
            sock = socket.create_server((address.host, address.port), family=family)
        except OSError as error:
            for opened in sockets:
                opened.close()
            raise ConfigError(f"cannot listen on {address.url} for {role}: {error.strerror}") from None
        sockets.append(sock)
    return sockets, ui_bind


def config_for_bind(config: ServerConfig, bind: BindAddress, ui_bind: BindAddress | None) -> ServerConfig:
    """``config`` with where the server listens, for the Host and Origin checks: the bind host, whether
    it is a unix socket, and the web UI's port (its origin is allowed)."""
    return dataclasses.replace(
        config,
        bind_host=bind.host,
        is_unix_socket=bind.uds is not None,
        ui_port=ui_bind.port if ui_bind is not None else None,
    )


def run_server(
    engine_kwargs: dict[str, Any],
    config: ServerConfig,
    bind: BindAddress,
    *,
    shutdown_timeout: float = 30.0,
    log_level: str = "warning",
    ui_server: bool = False,
    limit_concurrency: int | None = None,
) -> int:
    """Serve until stopped; returns the process exit code (1 if the model failed to load).

    With ``ui_server`` the web UI is served too, on the API port minus one (see :mod:`framework.server.webui`).
    ``limit_concurrency``: uvicorn answers 503 to connections and requests beyond this many at once.
    """
    sockets, ui_bind = bind_sockets(bind, ui_server)
    config = config_for_bind(config, bind, ui_bind)
    client = AsyncEngineClient(
        engine_kwargs,
        restart=config.engine_restart,
        heartbeat_timeout_s=config.engine_heartbeat_timeout_s,
        chat_template=config.chat_template,
    )
    failure: list[str] = []
    server: _Server | None = None

    def on_ready(ready: Ready) -> None:
        print(format_summary(ready), flush=True)
        print(f"  tools      {tool_calling_line(server.state)}", flush=True)
        server.engine_ready = True
        server.announce()

    def on_load_error(message: str) -> None:
        failure.append(message)
        print(f"fw: error: could not load the model: {message}", file=sys.stderr, flush=True)
        server.should_exit = True

    app = create_app(client, config, on_ready=on_ready, on_load_error=on_load_error)
    asgi_app = app
    if ui_bind is not None:
        from framework.server.webui import WebUIApp

        asgi_app = WebUIApp(app, ui_bind.port)
    uv_config = uvicorn.Config(
        asgi_app,
        host=bind.host or DEFAULT_HOST,
        port=bind.port or 0,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=shutdown_timeout,
        timeout_keep_alive=30,
        limit_concurrency=limit_concurrency,
    )
    ui_url = None
    if ui_bind is not None:  # a wildcard address is not one to browse to
        browsable = ui_bind._replace(host="localhost") if ui_bind.host in ("0.0.0.0", "::") else ui_bind
        ui_url = browsable.url
    server = _Server(uv_config, app.state.server, bind.url, ui_url)
    server.run(sockets=sockets)
    return 1 if failure else 0
