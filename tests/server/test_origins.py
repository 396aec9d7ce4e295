"""Who may drive the API: Host check (DNS rebinding), foreign origins, CORS, JSON-only bodies.

The real Litestar app with the scripted engine client (a real tokenizer), through Litestar's test
client; ``/tokenize`` is the request that reaches a handler and answers the prompt's real token ids.
"""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from framework.server.app import create_app
from framework.server.state import ServerConfig

from .scripted_engine import ScriptedEngineClient

API = "http://127.0.0.1:2000"
BODY = {"prompt": "hello"}


def _client(**config) -> tuple[TestClient, ScriptedEngineClient]:
    engine = ScriptedEngineClient(lambda prompt: "")
    app = create_app(engine, ServerConfig(served_model_names=["m"], **config), start_engine=False)
    return TestClient(app, base_url=API), engine


@pytest.fixture
def http():
    client, engine = _client()
    with client:
        client.expected_tokens = engine.tokenizer.encode("hello", add_special_tokens=True)
        yield client


def _error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"], error
    return error


def test_plain_json_post_without_origin_reaches_the_handler(http):
    response = http.post("/tokenize", json=BODY)
    assert response.status_code == 200 and response.json()["tokens"] == http.expected_tokens
    assert "access-control-allow-origin" not in response.headers


@pytest.mark.parametrize("origin", ["null", "http://localhost.evil.example:2000", "http://127.0.0.1.nip.io:2000"])
def test_opaque_and_look_alike_origins_are_foreign(http, origin):
    _error(http.post("/tokenize", json=BODY, headers={"Origin": origin}), 403, "cross_origin_refused")


def test_a_foreign_pages_text_plain_post_is_refused(http):
    # What a page on another site can send without a preflight: a "simple" cross-origin POST.
    response = http.post(
        "/tokenize",
        content=b'{"prompt": "hello"}',
        headers={"Content-Type": "text/plain", "Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"},
    )
    error = _error(response, 403, "cross_origin_refused")
    assert "https://evil.example" in error["message"] and "--allowed-origins" in error["message"]


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx"],
)
def test_post_bodies_must_be_application_json(http, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    response = http.post("/tokenize", content=b'{"prompt": "hello"}', headers=headers)
    error = _error(response, 415, "unsupported_media_type")
    assert "application/json" in error["message"] and error["param"] == "Content-Type"


def test_json_with_a_charset_is_accepted(http):
    response = http.post(
        "/tokenize", content=b'{"prompt": "hello"}', headers={"Content-Type": "application/json; charset=utf-8"}
    )
    assert response.status_code == 200 and response.json()["tokens"] == http.expected_tokens


@pytest.mark.parametrize("host", ["evil.com", "evil.com:2000", "attacker.example:80"])
def test_dns_rebinding_host_is_refused(http, host):
    response = http.post("/tokenize", json=BODY, headers={"Host": host, "Origin": f"http://{host}"})
    error = _error(response, 421, "invalid_host")
    assert host.split(":")[0] in error["message"] and "--allowed-hosts" in error["message"]
    _error(http.get("/v1/models", headers={"Host": host}), 421, "invalid_host")


@pytest.mark.parametrize(
    "host", ["localhost:2000", "127.0.0.1:2000", "[::1]:2000", "192.168.1.5:2000", "LOCALHOST", "app.localhost:2000"]
)
def test_loopback_names_and_ip_addresses_are_accepted_hosts(http, host):
    assert http.get("/v1/models", headers={"Host": host}).json()["data"][0]["id"] == "m"


def test_bind_address_and_allowed_hosts_are_accepted_hosts():
    client, _ = _client(bind_host="gpu-box.lan", allowed_hosts=["fw.internal", "named.lan:2000"])
    with client:
        for host in ("gpu-box.lan:2000", "fw.internal", "localhost", "named.lan:2000"):
            assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host
        _error(client.get("/v1/models", headers={"Host": "other.lan"}), 421, "invalid_host")
    anything, _ = _client(allowed_hosts=["*"])
    with anything:
        assert anything.get("/v1/models", headers={"Host": "other.lan"}).status_code == 200


def test_a_unix_socket_server_accepts_any_host():
    client, _ = _client(bind_host=None, is_unix_socket=True)
    with client:
        assert client.get("/v1/models", headers={"Host": "fw"}).status_code == 200


def test_cross_site_fetch_metadata_is_refused_without_an_origin(http):
    error = _error(http.get("/v1/models", headers={"Sec-Fetch-Site": "cross-site"}), 403, "cross_origin_refused")
    assert error["param"] == "Sec-Fetch-Site"
    for site in ("same-origin", "none"):
        assert http.get("/v1/models", headers={"Sec-Fetch-Site": site}).status_code == 200


def test_the_servers_own_origin_is_same_origin(http):
    response = http.post("/tokenize", json=BODY, headers={"Origin": API, "Sec-Fetch-Site": "same-origin"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
    other_port = http.post("/tokenize", json=BODY, headers={"Origin": "http://127.0.0.1:3000"})
    _error(other_port, 403, "cross_origin_refused")


def test_the_web_ui_origin_is_allowed_and_still_needs_the_key():
    client, _ = _client(ui_port=1999, api_keys=["secret"])
    ui = {"Origin": "http://127.0.0.1:1999", "Sec-Fetch-Site": "same-site"}
    with client:
        _error(client.post("/tokenize", json=BODY, headers=ui), 401, "invalid_api_key")
        allowed = client.post("/tokenize", json=BODY, headers={**ui, "Authorization": "Bearer secret"})
        assert allowed.status_code == 200 and allowed.json()["count"] > 0
        _error(
            client.post(
                "/tokenize", json=BODY, headers={"Origin": "http://127.0.0.1:1998", "Authorization": "Bearer secret"}
            ),
            403,
            "cross_origin_refused",
        )


def test_no_cors_by_default_preflight_is_refused(http):
    response = http.options(
        "/v1/chat/completions",
        headers={
            "Origin": "http://localhost:5173",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    _error(response, 403, "cross_origin_refused")
    assert "access-control-allow-origin" not in response.headers


def test_allowed_origin_gets_a_preflight_and_cors_headers():
    client, engine = _client(allowed_origins=["http://localhost:5173"], api_keys=["k"])
    origin = {"Origin": "http://localhost:5173"}
    with client:
        preflight = client.options(
            "/tokenize",
            headers={
                **origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 204, preflight.text
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        allowed_headers = {h.strip() for h in preflight.headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type"} <= allowed_headers
        response = client.post(
            "/tokenize", json=BODY, headers={**origin, "Authorization": "Bearer k", "Sec-Fetch-Site": "cross-site"}
        )
        assert response.status_code == 200
        assert response.json()["tokens"] == engine.tokenizer.encode("hello", add_special_tokens=True)
        assert response.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert "Origin" in response.headers["vary"]
        not_json = client.post("/tokenize", content=b"{}", headers={**origin, "Content-Type": "text/plain"})
        _error(not_json, 415, "unsupported_media_type")  # readable by the allowed page: it has CORS headers
        assert not_json.headers["access-control-allow-origin"] == "http://localhost:5173"
        refused = client.post(
            "/tokenize", json=BODY, headers={"Origin": "http://localhost:5174", "Authorization": "Bearer k"}
        )
        _error(refused, 403, "cross_origin_refused")


def test_allowed_origins_values_are_checked():
    from framework.errors import ConfigError
    from framework.server.origins import check_origins

    assert check_origins(["HTTP://LocalHost:5173/", "*"]) == ["http://localhost:5173", "*"]
    for bad in ("localhost:5173", "ftp://x", "http://x/path", "http://"):
        with pytest.raises(ConfigError, match="--allowed-origins"):
            check_origins([bad])
