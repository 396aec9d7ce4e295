"""The Litestar app with a stand-in engine client (no engine process): loading, draining, dead engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from litestar.testing import TestClient

from framework.server.app import create_app
from framework.server.state import ServerConfig

#: A loopback address: the app answers only Host names it accepts (see framework/server/origins.py).
BASE_URL = "http://127.0.0.1:2000"


class StandInClient:
    """Just enough of AsyncEngineClient for requests that never reach the engine."""

    is_restarting = False
    is_unresponsive = False
    num_restarts = 0

    def __init__(self, ready: bool) -> None:
        self.ready = SimpleNamespace(max_model_len=64, vocab_size=32) if ready else None
        self.dead_reason = None
        self.tokenizer = None
        self.shut_down = False

    @property
    def is_ready(self) -> bool:
        return self.ready is not None and self.dead_reason is None

    @property
    def is_healthy(self) -> bool:
        return False

    async def shutdown(self) -> None:
        self.shut_down = True


def _app(ready: bool, **config):
    client = StandInClient(ready)
    return create_app(client, ServerConfig(served_model_names=["m"], **config), start_engine=False), client


def test_while_loading_health_and_api_answer_503():
    app, client = _app(ready=False)
    with TestClient(app, base_url=BASE_URL) as http:
        assert http.get("/health").json() == {"status": "loading"}
        response = http.post("/v1/chat/completions", json={"messages": []})
        assert response.status_code == 503 and response.json()["error"]["code"] == "model_loading"
        assert response.headers["Retry-After"] == "1"
        assert http.get("/version").status_code == 200
    assert client.shut_down  # the lifespan stops the engine client


def test_draining_server_refuses_new_requests():
    app, _ = _app(ready=True)
    with TestClient(app, base_url=BASE_URL) as http:
        app.state.server.is_draining = True
        assert http.get("/health").status_code == 503
        response = http.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "server_draining"


def test_dead_engine_makes_health_503_with_the_reason():
    app, client = _app(ready=True)
    client.dead_reason = "the engine process exited (code -9)"
    with TestClient(app, base_url=BASE_URL) as http:
        health = http.get("/health")
        assert health.status_code == 503 and "code -9" in health.json()["message"]
        assert http.post("/v1/completions", json={"prompt": "x"}).json()["error"]["code"] == "engine_dead"


@pytest.mark.parametrize("keys", [["a"], ["a", "b"]])
def test_api_keys_guard_the_api_but_not_health(keys):
    app, _ = _app(ready=True, api_keys=keys)
    with TestClient(app, base_url=BASE_URL) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").json()["error"]["code"] == "invalid_api_key"
        for key in keys:
            assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"][0]["id"] == "m"


def test_queue_cap_is_checked_before_the_request_is_tokenized():
    app, _ = _app(ready=True, max_num_seqs=1, max_queued_requests=0)
    with TestClient(app, base_url=BASE_URL) as http:
        app.state.server.num_admitted = 1
        response = http.post("/v1/completions", json={"prompt": "x"})  # the stand-in has no tokenizer
        assert response.status_code == 429 and response.headers["Retry-After"] == "1"


def test_model_ids_with_slashes_are_found():
    client = StandInClient(ready=True)
    app = create_app(client, ServerConfig(served_model_names=["org/model-1"]), start_engine=False)
    with TestClient(app, base_url=BASE_URL) as http:
        assert http.get("/v1/models/org/model-1").json()["id"] == "org/model-1"
        assert http.get("/v1/models/org/other").json()["error"]["code"] == "model_not_found"


def test_token_cap_is_checked_before_the_request_is_tokenized():
    app, _ = _app(ready=True, max_queued_tokens=100)
    with TestClient(app, base_url=BASE_URL) as http:
        app.state.server.num_admitted_tokens = 100
        response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert response.status_code == 429 and "--max-queued-tokens 100" in response.json()["error"]["message"]
        assert response.headers["Retry-After"] == "1"


def test_admission_counts_tokens_and_releases_once():
    app, _ = _app(ready=True, max_queued_tokens=10)
    state = app.state.server
    admission = state.admit(2)
    admission.add_tokens(12)
    assert (state.num_admitted, state.num_admitted_tokens) == (2, 12)
    with pytest.raises(Exception, match="max-queued-tokens"):
        state.admit(1)
    admission()
    admission()
    assert (state.num_admitted, state.num_admitted_tokens) == (0, 0)
    state.admit(1)()


def test_api_keys_are_compared_in_constant_time(monkeypatch):
    import hmac

    from framework.server import app as app_module

    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(app_module.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    assert app_module.is_known_key("b", ["a", "b", "c"]) and not app_module.is_known_key("d", ["a", "b"])
    assert not app_module.is_known_key(None, ["a"])
    # every key is compared (no early exit on a match), as bytes
    assert compared == [(b"b", b"a"), (b"b", b"b"), (b"b", b"c"), (b"d", b"a"), (b"d", b"b")]
