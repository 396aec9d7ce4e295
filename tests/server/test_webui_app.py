"""The web UI's server side: the committed bundle matches its sources, and WebUIApp routes by port.

No Node.js and no browser here (tests/server/test_webui_browser.py drives Chromium).
"""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import httpx
import pytest

from framework.distributed.config import free_port
from framework.errors import ConfigError
from framework.server.launcher import BindAddress, bind_sockets
from framework.server.webui import (
    CONTENT_SECURITY_POLICY,
    SOURCE_HASH_FILE,
    STATIC_DIR,
    WebUIApp,
    source_hash,
    ui_port_for,
)

REPO = Path(__file__).resolve().parents[2]


def test_committed_bundle_was_built_from_the_current_sources():
    recorded = (STATIC_DIR / SOURCE_HASH_FILE).read_text().strip()
    assert (REPO / "ui" / "package-lock.json").is_file()
    assert recorded == source_hash(REPO / "ui"), (
        "framework/server/webui/static is stale: ui/ changed since the bundle was built; run `make ui` and commit"
    )


def test_bundle_index_references_only_files_that_exist():
    html = (STATIC_DIR / "index.html").read_text()
    assets = re.findall(r'(?:src|href)="/(assets/[^"]+)"', html)
    assert any(a.endswith(".js") for a in assets) and any(a.endswith(".css") for a in assets), html
    for asset in assets:
        assert (STATIC_DIR / asset).is_file(), asset


async def _api_app(scope, receive, send):
    """Stands in for the API app: answers every request with its path."""
    if scope["type"] != "http":
        return
    body = f"api:{scope['path']}".encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def webui():
    return WebUIApp(_api_app, ui_port=1999)


def _get(app, url: str) -> httpx.Response:
    async def main() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            return await client.get(url)

    return asyncio.run(main())


def test_ui_port_serves_the_page_with_a_content_security_policy(webui):
    response = _get(webui, "http://127.0.0.1:1999/")
    assert response.status_code == 200
    assert '<div id="app">' in response.text
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert (
        "script-src 'self'" in CONTENT_SECURITY_POLICY
        and "unsafe-inline" not in CONTENT_SECURITY_POLICY.split("script-src")[1].split(";")[0]
    )
    asset = re.search(r'src="(/assets/[^"]+\.js)"', response.text).group(1)
    script = _get(webui, f"http://127.0.0.1:1999{asset}")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]


@pytest.mark.parametrize("path", ["/v1/models", "/v1/chat/completions", "/health", "/metrics", "/version"])
def test_ui_port_forwards_api_paths_to_the_api_app(webui, path):
    response = _get(webui, f"http://127.0.0.1:1999{path}")
    assert response.text == f"api:{path}"


def test_api_port_never_serves_the_ui(webui):
    response = _get(webui, "http://127.0.0.1:2000/")
    assert response.text == "api:/"


def test_ui_port_is_the_api_port_minus_one():
    assert ui_port_for(2000) == 1999


@pytest.mark.parametrize(
    ("bind", "message"),
    [
        (BindAddress(None, None, "/tmp/fw.sock"), "needs a TCP address"),
        (BindAddress("127.0.0.1", 0, None), "give a port >= 2 with --p"),
    ],
)
def test_ui_server_rejects_addresses_without_a_port_below(bind, message):
    with pytest.raises(ConfigError, match=message):
        bind_sockets(bind, ui_server=True)


def test_ui_server_says_which_port_is_taken():
    for _ in range(20):
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            ui_port = busy.getsockname()[1]
            try:
                bind_sockets(BindAddress("127.0.0.1", ui_port + 1, None), ui_server=True)
            except ConfigError as error:
                if "for the API" in str(error):
                    continue  # another process holds the port above; try another pair
                assert str(error).startswith(f"cannot listen on http://127.0.0.1:{ui_port} for the web UI")
                return
            pytest.fail("bind_sockets bound a port that is in use")
    pytest.fail("found no port whose port above was free")


def test_ui_server_binds_the_api_port_and_the_one_below():
    for _ in range(20):
        port = free_port()
        try:
            sockets, ui_bind = bind_sockets(BindAddress("127.0.0.1", port, None), ui_server=True)
        except ConfigError:
            continue  # the port below was taken; try another pair
        try:
            assert [s.getsockname()[1] for s in sockets] == [port, port - 1]
            assert ui_bind.url == f"http://127.0.0.1:{port - 1}"
        finally:
            for sock in sockets:
                sock.close()
        return
    pytest.fail("found no free pair of adjacent ports")


def test_without_ui_server_uvicorn_binds_the_api_itself():
    assert bind_sockets(BindAddress("127.0.0.1", 2000, None), ui_server=False) == (None, None)


def test_ui_port_applies_the_api_key_rules_of_the_real_app():
    from types import SimpleNamespace

    from framework.server.app import create_app
    from framework.server.state import ServerConfig

    client = SimpleNamespace(
        ready=SimpleNamespace(max_model_len=64, vocab_size=32), dead_reason=None, is_ready=True, is_restarting=False
    )
    api = create_app(client, ServerConfig(served_model_names=["m"], api_keys=["secret"]), start_engine=False)
    webui = WebUIApp(api, ui_port=1999)

    async def main() -> tuple[httpx.Response, ...]:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=webui), base_url="http://127.0.0.1:1999"
        ) as http:
            return (
                await http.get("/"),
                await http.get("/v1/models"),
                await http.get("/v1/models", headers={"Authorization": "Bearer secret"}),
            )

    page, refused, allowed = asyncio.run(main())
    assert page.status_code == 200  # the page itself needs no key: it asks for one
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert allowed.status_code == 200 and [m["id"] for m in allowed.json()["data"]] == ["m"]


def test_the_ui_pages_own_requests_pass_the_origin_checks_of_the_real_app():
    """What the page on the UI port sends (same origin, JSON) reaches the API; a foreign page's does not."""
    from framework.server.app import create_app
    from framework.server.launcher import config_for_bind
    from framework.server.state import ServerConfig

    from .scripted_engine import ScriptedEngineClient

    engine = ScriptedEngineClient(lambda prompt: "")
    config = config_for_bind(
        ServerConfig(served_model_names=["m"]), BindAddress("0.0.0.0", 2000, None), BindAddress("0.0.0.0", 1999, None)
    )
    assert (config.bind_host, config.ui_port, config.is_unix_socket) == ("0.0.0.0", 1999, False)
    webui = WebUIApp(create_app(engine, config, start_engine=False), ui_port=1999)
    expected = engine.tokenizer.encode("hi", add_special_tokens=True)

    async def main() -> tuple[httpx.Response, ...]:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=webui), base_url="http://192.168.1.5:1999"
        ) as http:
            page = {"Origin": "http://192.168.1.5:1999", "Sec-Fetch-Site": "same-origin"}
            return (
                await http.post("/tokenize", json={"prompt": "hi"}, headers=page),
                await http.post(
                    "http://192.168.1.5:2000/tokenize",
                    json={"prompt": "hi"},
                    headers={**page, "Sec-Fetch-Site": "same-site"},
                ),
                await http.post("/tokenize", json={"prompt": "hi"}, headers={"Origin": "https://evil.example"}),
            )

    same_origin, ui_to_api_port, foreign = asyncio.run(main())
    assert same_origin.status_code == 200 and same_origin.json()["tokens"] == expected
    assert ui_to_api_port.status_code == 200 and ui_to_api_port.json()["tokens"] == expected
    assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "cross_origin_refused"
