"""The host calls the app and lifecycle hooks: a fixture plugin adds a route, sees the app config,
and counts its ``startup`` / ``shutdown`` calls around the engine's life (server and ``LLM``)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from litestar import get
from litestar.testing import TestClient

from framework import hookimpl
from framework.server.app import create_app
from framework.server.state import ServerConfig

BASE_URL = "http://127.0.0.1:2000"


class LifecyclePlugin:
    """Adds ``GET /plugin/ping`` and records every call of the four hooks."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    @hookimpl
    def register_routes(self):
        @get("/plugin/ping", sync_to_thread=False)
        def ping() -> dict[str, str]:
            return {"pong": "fixture"}

        return [ping]

    @hookimpl
    def app_init(self, app_config):
        self.calls.append(("app_init", [getattr(h, "paths", None) for h in app_config.route_handlers]))

    @hookimpl
    def startup(self, engine):
        async def started() -> None:  # an awaitable: the host awaits it
            await asyncio.sleep(0)
            self.calls.append(("startup", engine))

        return started()

    @hookimpl
    def shutdown(self, engine):
        self.calls.append(("shutdown", engine))

    def count(self, name: str) -> int:
        return sum(1 for call, _ in self.calls if call == name)


class ReadyClient:
    """Just enough of AsyncEngineClient: ready at once (or after ``start``), no engine process."""

    is_restarting = False
    is_unresponsive = False
    is_healthy = False
    num_restarts = 0
    dead_reason = None
    tokenizer = None

    def __init__(self, ready: bool) -> None:
        self.ready = SimpleNamespace(max_model_len=64, vocab_size=32) if ready else None
        self.events: list[str] = []

    @property
    def is_ready(self) -> bool:
        return self.ready is not None

    async def start(self):
        self.events.append("start")
        await asyncio.sleep(0.05)
        self.ready = SimpleNamespace(max_model_len=64, vocab_size=32)
        return self.ready

    async def shutdown(self) -> None:
        self.events.append("shutdown")


@pytest.fixture
def lifecycle(register_fw_plugin) -> LifecyclePlugin:
    plugin = LifecyclePlugin()
    register_fw_plugin(plugin, name="lifecycle-fixture")
    return plugin


def test_a_plugin_route_answers_and_startup_and_shutdown_run_once_around_the_app(lifecycle):
    client = ReadyClient(ready=True)
    app = create_app(client, ServerConfig(served_model_names=["m"]), start_engine=False)
    assert lifecycle.count("app_init") == 1
    ((_, handlers),) = [call for call in lifecycle.calls if call[0] == "app_init"]
    assert {"/plugin/ping"} in handlers  # app_init sees the config with the plugin's route in it
    with TestClient(app, base_url=BASE_URL) as http:
        assert lifecycle.calls[-1] == ("startup", client)
        response = http.get("/plugin/ping")
        assert response.status_code == 200 and response.json() == {"pong": "fixture"}
        assert lifecycle.count("shutdown") == 0
    assert [name for name, _ in lifecycle.calls] == ["app_init", "startup", "shutdown"]
    assert lifecycle.calls[-1] == ("shutdown", client) and client.events == ["shutdown"]


def test_startup_waits_for_the_engine_the_app_starts(lifecycle):
    client = ReadyClient(ready=False)
    app = create_app(client, ServerConfig(served_model_names=["m"]))
    with TestClient(app, base_url=BASE_URL) as http:
        for _ in range(100):
            if lifecycle.count("startup"):
                break
            http.get("/health")  # lets the portal's loop run the start task
            time.sleep(0.02)
        assert client.events == ["start"] and lifecycle.calls[-1] == ("startup", client)
    assert lifecycle.count("startup") == lifecycle.count("shutdown") == 1
    assert client.events == ["start", "shutdown"]


def test_no_shutdown_hook_for_an_engine_that_never_started(lifecycle):
    class NeverReady(ReadyClient):
        async def start(self):
            await asyncio.sleep(3600)

    client = NeverReady(ready=False)
    with TestClient(create_app(client, ServerConfig(served_model_names=["m"])), base_url=BASE_URL) as http:
        assert http.get("/health").json() == {"status": "loading"}
    assert lifecycle.count("startup") == lifecycle.count("shutdown") == 0


def test_llm_calls_startup_with_its_engine_and_shutdown_once_on_close(lifecycle, tmp_path):
    import transformers

    from framework import LLM
    from framework.testing import write_tiny_model

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    write_tiny_model(tmp_path, config)
    llm = LLM(str(tmp_path), device="cpu", num_blocks=8)
    assert lifecycle.calls == [("startup", llm.engine)]
    llm.close()
    llm.close()
    assert lifecycle.calls == [("startup", llm.engine), ("shutdown", llm.engine)]
