"""Images in the web UI, in headless Chromium, against the real API app and a scripted vision model.

The scripted engine (tests/server/scripted_engine.py) takes images as Qwen2-VL does, with that
model's image processor at tiny sizes, and answers with how many images (and image tokens) reached
it. Each image is attached with the button's file picker, pasted or dropped (a dropped file that is
no image is refused); the request body the
server got is read back (an ASGI recorder in front of the app), and each ``image_url`` part must
hold the file's very bytes, and the engine the processor's pixels of them. An image over the
server's limits (a low ``--max-request-bytes``) is scaled down to fit. After a reload a follow-up
sends the same images again (kept in IndexedDB); with that store cleared the conversation shows
the thumbnails it kept in localStorage, says so, and a follow-up sends those. A text-only model's card
has no ``vision``, and the UI disables attaching with the reason. Screenshots go to
``test-artifacts/webui/`` (git-ignored).
"""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import expect

from framework.multimodal.images import to_rgb
from framework.multimodal.inputs import load_processor
from framework.server.app import create_app
from framework.server.state import ServerConfig
from framework.server.webui import WebUIApp
from framework.testing import random_image

from .conftest import CHROMIUM
from .conftest import WEBUI_ARTIFACTS as ARTIFACTS
from .scripted_engine import ScriptedEngineClient, ThreadedServer, scripted_vision_engine

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (`make test` installs Debian's chromium)"
)

#: The UI keeps thumbnails of at most this side (ui/src/images.js THUMBNAIL_SIDE).
THUMBNAIL_SIDE = 384
#: Where the UI keeps conversations (localStorage) and full images (IndexedDB): ui/src/store.js, imageStore.js.
CONVERSATIONS = "fw.conversations.v1"
CLEAR_IMAGE_STORE = """() => new Promise((resolve, reject) => {
    const request = indexedDB.open('fw.images');
    request.onerror = () => reject(request.error);
    request.onsuccess = () => {
        const tx = request.result.transaction('images', 'readwrite');
        tx.objectStore('images').clear();
        tx.oncomplete = () => { request.result.close(); resolve(); };
        tx.onerror = () => reject(tx.error);
    };
})"""


class BodyRecorder:
    """ASGI middleware keeping the JSON body of every ``POST /v1/chat/completions`` (in ``bodies``)."""

    def __init__(self, app) -> None:
        self.app = app
        self.bodies: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.bodies.append(json.loads(b"".join(chunks)))
            return message

        return await self.app(scope, recording_receive, send)


def encoded(image: Image.Image, image_format: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


def data_url_bytes(part: dict) -> tuple[str, bytes]:
    """The MIME type and bytes of an ``image_url`` content part's ``data:`` URL."""
    assert part["type"] == "image_url", part
    header, _, payload = part["image_url"]["url"].partition(",")
    mime = re.fullmatch(r"data:(image/[a-z]+);base64", header)
    assert mime, header
    return mime.group(1), base64.b64decode(payload)


def image_urls(body: dict) -> list[str]:
    """The ``data:`` URLs of every image part of a chat request's messages, in order."""
    return [
        part["image_url"]["url"]
        for message in body["messages"]
        if isinstance(message["content"], list)
        for part in message["content"]
        if part["type"] == "image_url"
    ]


def with_files(page, files: list[tuple[str, str, bytes]]):
    """A DataTransfer in the page holding ``files`` (name, MIME type, bytes), as a paste or a drop brings."""
    return page.evaluate_handle(
        """(files) => {
            const transfer = new DataTransfer();
            for (const [name, type, b64] of files) {
                const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
                transfer.items.add(new File([bytes], name, { type }));
            }
            return transfer;
        }""",
        [[name, mime, base64.b64encode(data).decode()] for name, mime, data in files],
    )


def paste(page, files) -> None:
    page.get_by_test_id("composer").evaluate(
        "(box, transfer) => box.dispatchEvent(new ClipboardEvent('paste', "
        "{ clipboardData: transfer, bubbles: true, cancelable: true }))",
        with_files(page, files),
    )


def drop(page, files, screenshot: str | None = None) -> None:
    transfer = with_files(page, files)
    main = page.locator("main")
    main.dispatch_event("dragover", {"dataTransfer": transfer})
    expect(page.get_by_test_id("drop-overlay")).to_be_visible()
    if screenshot:
        page.screenshot(path=str(ARTIFACTS / screenshot))
    main.dispatch_event("drop", {"dataTransfer": transfer})
    expect(page.get_by_test_id("drop-overlay")).to_have_count(0)


def send(page, text: str) -> None:
    page.get_by_test_id("composer").fill(text)
    page.get_by_test_id("composer").press("Enter")


def describe_images(engine: ScriptedEngineClient) -> str:
    images = engine.images[-1] or []
    return f"I see {len(images)} image(s), {sum(image.length for image in images)} image tokens."


def test_attached_pasted_and_dropped_images_reach_the_model_byte_for_byte(browser, free_tcp_port):
    engine = scripted_vision_engine(lambda prompt: describe_images(engine))
    config = ServerConfig(served_model_names=["scripted-vision"], max_request_bytes=2 << 20)
    app = BodyRecorder(create_app(engine, config, start_engine=False))
    processor = load_processor(engine.ready.vision)
    attached = encoded(random_image(96, 64, 1), "PNG")
    removed = encoded(random_image(50, 50, 2), "PNG")
    pasted = encoded(random_image(80, 120, 3), "PNG")
    dropped = encoded(random_image(120, 72, 4), "JPEG")
    large = encoded(random_image(640, 480, 5), "PNG")  # noise: ~900 KB, over this server's budget
    port = free_tcp_port()
    with ThreadedServer(WebUIApp(app, ui_port=port), port) as running:
        vision = httpx.get(f"{running.base_url}/v1/models").json()["data"][0]["vision"]
        assert vision["max_images"] == 8 and vision["max_request_bytes"] == 2 << 20
        # The UI's budget per image: 3/4 of the body for a conversation's 8 images, base64-encoded.
        budget = int(min(vision["max_image_bytes"], vision["max_request_bytes"] * 3 / 4 / 8 * 3 / 4))
        assert len(large) > budget > max(map(len, (attached, pasted, dropped)))

        page = browser.new_page(viewport={"width": 1100, "height": 850})
        errors = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(running.base_url)
        expect(page.get_by_test_id("model-picker")).to_have_value("scripted-vision")
        expect(page.get_by_test_id("model-vision")).to_have_text("images")
        expect(page.get_by_test_id("attach")).to_be_enabled()

        # The attach button's file picker: two images; the second one removed again.
        with page.expect_file_chooser() as chooser:
            page.get_by_test_id("attach").click()
        chooser.value.set_files(
            [
                {"name": "attached.png", "mimeType": "image/png", "buffer": attached},
                {"name": "removed.png", "mimeType": "image/png", "buffer": removed},
            ]
        )
        tiles = page.get_by_test_id("attachment")
        expect(tiles).to_have_count(2)
        expect(tiles.first.locator("img")).to_have_attribute("src", re.compile(r"^data:image/jpeg;base64,"))
        page.get_by_role("button", name="Remove removed.png").click()
        expect(tiles).to_have_count(1)
        expect(tiles.first).to_have_attribute("title", "attached.png · 96×64")
        page.get_by_test_id("composer").fill("What is in this picture?")
        page.screenshot(path=str(ARTIFACTS / "image-attached.png"))
        page.get_by_test_id("composer").press("Enter")
        expect(page.get_by_test_id("assistant-message").last).to_contain_text("I see 1 image(s), 6 image tokens.")
        expect(tiles).to_have_count(0)
        expect(page.get_by_test_id("message-image")).to_have_count(1)
        image_part, text_part = app.bodies[-1]["messages"][-1]["content"]
        assert data_url_bytes(image_part) == ("image/png", attached)
        assert text_part == {"type": "text", "text": "What is in this picture?"}
        expected = processor.preprocess(to_rgb(Image.open(io.BytesIO(attached))))
        np.testing.assert_array_equal(engine.images[-1][0].array(), expected.pixel_values)
        page.screenshot(path=str(ARTIFACTS / "image-sent.png"))

        # Pasted and dropped, in a new chat: both sent, in order, as they were.
        page.get_by_test_id("new-chat").click()
        paste(page, [("pasted.png", "image/png", pasted)])
        expect(tiles).to_have_count(1)
        drop(page, [("dropped.jpg", "image/jpeg", dropped)], screenshot="image-drop.png")
        expect(tiles).to_have_count(2)
        drop(page, [("notes.txt", "text/plain", b"not an image")])
        expect(page.get_by_test_id("attach-notice")).to_have_text("Only images can be attached")
        expect(tiles).to_have_count(2)
        send(page, "Compare these two.")
        expect(page.get_by_test_id("assistant-message").last).to_contain_text("I see 2 image(s)")
        parts = app.bodies[-1]["messages"][-1]["content"]
        assert [data_url_bytes(part) for part in parts[:2]] == [("image/png", pasted), ("image/jpeg", dropped)]
        assert parts[2] == {"type": "text", "text": "Compare these two."}

        # Over the server's limits: scaled down (same aspect) and re-encoded until it fits the budget.
        page.get_by_test_id("attach-input").set_input_files(
            {"name": "large.png", "mimeType": "image/png", "buffer": large}
        )
        expect(tiles.get_by_test_id("scaled")).to_have_count(1)
        expect(tiles.first).to_have_attribute("title", re.compile(r"scaled down from 640×480"))
        page.get_by_test_id("send").click()  # an image alone, no text
        expect(page.get_by_test_id("assistant-message").last).to_contain_text("I see 3 image(s)")
        (part,) = app.bodies[-1]["messages"][-1]["content"]
        mime, data = data_url_bytes(part)
        sent = Image.open(io.BytesIO(data))
        assert mime == "image/jpeg" and sent.format == "JPEG" and len(data) <= budget
        assert sent.width < 640 and abs(sent.width / sent.height - 640 / 480) < 0.02

        # A reload keeps the conversations, and their full images (in IndexedDB): a follow-up sends them as sent.
        sent = image_urls(app.bodies[-1])
        page.wait_for_function(
            f'() => (localStorage.getItem({CONVERSATIONS!r}).match(/"stored":true/g) || []).length === 4'
        )
        page.reload()
        expect(page.get_by_test_id("conversation")).to_have_count(2)
        expect(page.get_by_test_id("message-image")).to_have_count(3)
        send(page, "And now?")
        expect(page.get_by_test_id("assistant-message")).to_have_count(3)
        expect(page.get_by_test_id("assistant-message").last).to_contain_text("I see 3 image(s)")
        assert image_urls(app.bodies[-1]) == sent and len(sent) == 3
        expect(page.get_by_test_id("thumbnail-note")).to_have_count(0)

        # Without the full copies (the store cleared, or a browser without IndexedDB): the thumbnails, and a note.
        page.evaluate(CLEAR_IMAGE_STORE)
        page.reload()
        expect(page.get_by_test_id("thumbnail-note")).to_have_count(2)
        page.screenshot(path=str(ARTIFACTS / "image-after-reload.png"))
        send(page, "And without them?")
        expect(page.get_by_test_id("assistant-message")).to_have_count(4)
        kept = [data_url_bytes({"type": "image_url", "image_url": {"url": url}}) for url in image_urls(app.bodies[-1])]
        sizes = [Image.open(io.BytesIO(data)).size for _, data in kept]
        assert {mime for mime, _ in kept} == {"image/jpeg"}
        assert sizes == [(80, 120), (120, 72), (THUMBNAIL_SIDE, THUMBNAIL_SIDE * 3 // 4)]
        assert not errors, errors
        page.close()


def test_a_text_only_model_disables_attaching_and_says_why(browser, free_tcp_port):
    engine = ScriptedEngineClient(lambda prompt: "text only")
    config = ServerConfig(served_model_names=["scripted-text"])
    image = [("photo.png", "image/png", encoded(random_image(32, 32, 6), "PNG"))]
    reason = "scripted-text does not take images (a text-only model)"
    port = free_tcp_port()
    with ThreadedServer(WebUIApp(create_app(engine, config, start_engine=False), ui_port=port), port) as running:
        assert httpx.get(f"{running.base_url}/v1/models").json()["data"][0]["vision"] is None
        page = browser.new_page(viewport={"width": 1000, "height": 700})
        page.goto(running.base_url)
        expect(page.get_by_test_id("model-vision")).to_have_text("text only")
        attach = page.get_by_test_id("attach")
        expect(attach).to_be_disabled()
        expect(attach).to_have_attribute("title", reason)
        paste(page, image)
        expect(page.get_by_test_id("attach-notice")).to_have_text(reason)
        transfer = with_files(page, image)
        page.locator("main").dispatch_event("dragover", {"dataTransfer": transfer})
        expect(page.get_by_test_id("drop-overlay")).to_contain_text(reason)
        page.screenshot(path=str(ARTIFACTS / "image-text-only.png"))
        page.locator("main").dispatch_event("drop", {"dataTransfer": transfer})
        expect(page.get_by_test_id("attachment")).to_have_count(0)
        send(page, "hello")
        expect(page.get_by_test_id("assistant-message").last).to_contain_text("text only")
        assert engine.images == [None]
        page.close()
