"""Who may drive the server: the Host header, the browser origin, CORS and JSON-only POST bodies.

A web page in the user's browser can send requests to a server on localhost (or on the LAN), and a
DNS-rebinding site can even make its own name point there. :class:`OriginGuard` (ASGI middleware of
the API app) refuses what a page could do uninvited, and leaves ordinary HTTP clients (curl, the
OpenAI SDKs: no ``Origin``, no ``Sec-Fetch-Site``) alone:

- a ``Host`` that is not a loopback name, an IP address, the bind address or in ``--allowed-hosts``
  is answered 421 (a rebinding page's requests carry its own name as the Host);
- a request from a foreign origin (an ``Origin`` other than the server's own, the web UI's, or one
  in ``--allowed-origins``; or ``Sec-Fetch-Site: cross-site`` with no allowed ``Origin``) is 403;
- an allowed origin gets CORS headers, and its preflight (``OPTIONS`` with
  ``Access-Control-Request-Method``) is answered here;
- a POST body must be ``application/json`` (415 otherwise), so an HTML form or a no-preflight
  ``text/plain`` fetch cannot reach a handler.

The API key check (app.py) comes on top of this: the web UI's origin is allowed, its requests still
need the key when one is set.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from framework.server.errors import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
ANY = "*"
#: Request headers an allowed origin may send (``*`` would not cover ``Authorization``).
CORS_ALLOW_HEADERS = (
    "authorization, content-type, openai-organization, openai-project, x-stainless-lang, "
    "x-stainless-package-version, x-stainless-os, x-stainless-arch, x-stainless-runtime, "
    "x-stainless-runtime-version, x-stainless-retry-count, x-stainless-timeout"
)
CORS_METHODS = "GET, POST, OPTIONS"
CORS_MAX_AGE_S = 600
JSON_MEDIA_TYPE = "application/json"


def host_name(host_header: str) -> str:
    """The name part of a ``Host`` header, lower-case, without the port or IPv6 brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(host: str | None) -> bool:
    """Whether binding ``host`` keeps the server on this machine (a loopback name or address)."""
    if host is None:
        return False
    name = host.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def normalize_origin(origin: str) -> str:
    """``scheme://host[:port]`` lower-case, without a trailing slash (how browsers send ``Origin``)."""
    return origin.strip().rstrip("/").lower()


def check_origins(origins: Iterable[str]) -> list[str]:
    """``--allowed-origins`` values, normalized; a value that is not ``*`` or ``scheme://host[:port]`` is an error."""
    from framework.errors import ConfigError

    result = []
    for origin in origins:
        value = normalize_origin(origin)
        scheme, sep, rest = value.partition("://")
        if value != ANY and (not sep or scheme not in ("http", "https") or not rest or "/" in rest):
            raise ConfigError(
                f"--allowed-origins {origin!r}: give an origin like http://localhost:5173 or "
                "https://app.example.com (scheme, host and optional port; no path), or *"
            )
        result.append(value)
    return result


@dataclass(slots=True, frozen=True)
class OriginPolicy:
    """What :class:`OriginGuard` accepts.

    ``allowed_hosts`` are Host names beyond loopback names and IP addresses (``*``: any Host);
    ``allowed_origins`` are normalized origins that may call cross-origin (``*``: any);
    ``ui_port`` is the web UI's port, whose origin on an accepted host name is always allowed.
    """

    allowed_hosts: frozenset[str]
    allowed_origins: frozenset[str]
    ui_port: int | None = None

    @classmethod
    def for_server(
        cls,
        bind_host: str | None,
        is_unix_socket: bool,
        allowed_hosts: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
        ui_port: int | None = None,
    ) -> OriginPolicy:
        """The policy of a server bound to ``bind_host`` (a unix socket is reached by no browser: any Host)."""
        hosts = {host_name(h) for h in allowed_hosts}  # a Host is compared without its port: so is an allowed one
        if is_unix_socket:
            hosts.add(ANY)
        if bind_host and bind_host.lower() not in WILDCARD_HOSTS:
            hosts.add(bind_host.strip("[]").lower())
        return cls(frozenset(hosts), frozenset(normalize_origin(o) for o in allowed_origins), ui_port)

    def is_host_allowed(self, name: str) -> bool:
        return (
            ANY in self.allowed_hosts
            or name in self.allowed_hosts
            or name in LOOPBACK_NAMES
            or name.endswith(".localhost")
            or is_ip_literal(name)
        )

    def is_cors_origin(self, origin: str) -> bool:
        return ANY in self.allowed_origins or origin in self.allowed_origins

    def is_own_origin(self, origin: str, scheme: str, host_header: str) -> bool:
        """``origin`` is this server's (the address the request was sent to) or the web UI's."""
        if origin == f"{scheme}://{host_header.strip().lower()}":
            return True
        if self.ui_port is None:
            return False
        name = host_name(host_header)
        shown = f"[{name}]" if ":" in name else name
        return origin == f"{scheme}://{shown}:{self.ui_port}"


class OriginGuard:
    """ASGI middleware enforcing an :class:`OriginPolicy` on HTTP requests (see the module docstring)."""

    def __init__(self, app: Any, policy: OriginPolicy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        host = headers.get("host", "")
        cors_origin = None
        try:
            cors_origin = self.check(scope, headers, host)
            check_media_type(scope, headers)
        except APIError as error:  # an allowed origin gets CORS headers on its errors too, to read them
            await _send(
                send,
                error.status,
                [(b"content-type", b"application/json")] + (_cors_headers(cors_origin) if cors_origin else []),
                msgspec.json.encode(error.body()),
            )
            return
        if cors_origin is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await _send(
                send,
                204,
                _cors_headers(cors_origin)
                + [
                    (b"access-control-allow-methods", CORS_METHODS.encode()),
                    (b"access-control-allow-headers", CORS_ALLOW_HEADERS.encode()),
                    (b"access-control-max-age", str(CORS_MAX_AGE_S).encode()),
                ],
                b"",
            )
            return

        async def send_with_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + _cors_headers(cors_origin)}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def check(self, scope: dict, headers: dict[str, str], host: str) -> str | None:
        """Raise the :class:`APIError` refusing the request's Host or origin, or return the CORS
        origin to answer (None: not a CORS request)."""
        policy = self.policy
        if host and not policy.is_host_allowed(host_name(host)):
            raise APIError(
                421,
                f"this server does not answer to the Host {host_name(host)!r} (it accepts loopback "
                "names, IP addresses and the bind address); start fw serve with --allowed-hosts "
                f"{host_name(host)} to allow it",
                param="Host",
                code="invalid_host",
            )
        origin = normalize_origin(headers["origin"]) if "origin" in headers else None
        cors_origin = None
        if origin is not None and not policy.is_own_origin(origin, scope.get("scheme", "http"), host):
            if not policy.is_cors_origin(origin):
                raise APIError(
                    403,
                    f"cross-origin requests from {origin!r} are refused; start fw serve with "
                    f"--allowed-origins {origin} to allow that site",
                    param="Origin",
                    code="cross_origin_refused",
                )
            cors_origin = origin
        elif origin is None and headers.get("sec-fetch-site") == "cross-site":
            raise APIError(
                403,
                "cross-site requests are refused (Sec-Fetch-Site: cross-site without an allowed "
                "Origin); see --allowed-origins",
                param="Sec-Fetch-Site",
                code="cross_origin_refused",
            )
        return cors_origin


def check_media_type(scope: dict, headers: dict[str, str]) -> None:
    """A POST body must be ``application/json`` (parameters such as a charset are fine): 415 otherwise."""
    if scope["method"] != "POST":
        return
    media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        shown = repr(headers["content-type"]) if "content-type" in headers else "none"
        raise APIError(
            415,
            f"request bodies must be JSON: send 'Content-Type: application/json' (got {shown})",
            param="Content-Type",
            code="unsupported_media_type",
        )


def _headers(scope: dict) -> dict[str, str]:
    return {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope.get("headers", [])}


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"vary", b"Origin"),
        (b"access-control-expose-headers", b"retry-after"),
    ]


async def _send(send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": headers + [(b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
