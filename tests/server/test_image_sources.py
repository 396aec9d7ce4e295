"""Image URLs beyond data URLs, where the operator opens them: files under
``--allowed-local-media-path`` and http(s) URLs of ``--allowed-media-domains`` (a loopback HTTP
server plays the web), each refused with a message naming the flag or the limit met; through the
real app, a fetched image reaches the engine as the same pixels its data URL gives."""

from __future__ import annotations

import http.server
import io
import threading
import time

import numpy as np
import pytest
from litestar.testing import TestClient

from framework.errors import ConfigError
from framework.multimodal.images import ImageError, decode_image_url
from framework.multimodal.sources import MediaSources
from framework.server.app import create_app
from framework.server.state import ServerConfig
from framework.testing import data_url, random_image

from .scripted_engine import scripted_vision_engine

IMAGE = random_image(40, 30, 5)


def png_bytes(image=IMAGE) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class _Handler(http.server.BaseHTTPRequestHandler):
    """``/cat.png``; ``/big`` (a Content-Length over the limit); ``/stream-big`` (no length, too many
    bytes); ``/slow`` (answers after the timeout); ``/redirect``; anything else 404."""

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/cat.png":
            self._send(200, png_bytes())
        elif self.path == "/big":
            self._send(200, b"x" * 20000)
        elif self.path == "/stream-big":
            self.send_response(200)
            self.end_headers()
            for _ in range(8):
                self.wfile.write(b"x" * 4096)
        elif self.path == "/slow":
            time.sleep(1.5)
            self._send(200, png_bytes())
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
        else:
            self._send(404, b"no")

    def _send(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a fetch given up mid-body breaks the pipe
        pass


@pytest.fixture(scope="module")
def web():
    server = _Server(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def test_files_under_the_allowed_directory_are_read_and_others_refused(tmp_path):
    media, outside = tmp_path / "media", tmp_path / "private"
    media.mkdir(), outside.mkdir()
    (media / "cat.png").write_bytes(png_bytes())
    (outside / "secret.png").write_bytes(png_bytes())
    (media / "link.png").symlink_to(outside / "secret.png")
    sources = MediaSources.from_flags(str(media), None)
    for url in (str(media / "cat.png"), f"file://{media / 'cat.png'}", f"{media}/../media/cat.png"):
        assert np.array_equal(pixels(decode_image_url(url, sources)), pixels(IMAGE)), url
    for url in (str(outside / "secret.png"), f"{media}/../private/secret.png", str(media / "link.png")):
        with pytest.raises(ImageError, match="outside the allowed media directory"):
            decode_image_url(url, sources)
    with pytest.raises(ImageError, match="is not a file"):
        decode_image_url(str(media / "missing.png"), sources)
    with pytest.raises(ImageError, match="names host"):
        decode_image_url(f"file://otherhost{media / 'cat.png'}", sources)
    with pytest.raises(ImageError, match="--allowed-local-media-path DIR"):  # the default reads no file
        decode_image_url(str(media / "cat.png"))


def test_urls_of_allowed_hosts_are_fetched_within_the_limits(web):
    sources = MediaSources(allowed_domains=("127.0.0.1",), fetch_timeout_s=0.5, max_bytes=16384)
    assert np.array_equal(pixels(decode_image_url(f"{web}/cat.png", sources)), pixels(IMAGE))
    refusals = {
        "/big": "larger than",
        "/stream-big": "larger than",
        "/slow": "longer than 0.5 s",
        "/redirect": "redirects are not followed",
        "/missing": "HTTP 404",
    }
    for path, message in refusals.items():
        with pytest.raises(ImageError, match=message):
            decode_image_url(web + path, sources)
    with pytest.raises(ImageError, match="not fetched from 'localhost'; allowed hosts: 127.0.0.1"):
        decode_image_url(web.replace("127.0.0.1", "localhost") + "/cat.png", sources)
    with pytest.raises(ImageError, match="--allowed-media-domains HOST"):  # the default fetches nothing
        decode_image_url(f"{web}/cat.png")
    anywhere = MediaSources(allowed_domains=("*",))
    assert np.array_equal(pixels(decode_image_url(f"{web}/cat.png", anywhere)), pixels(IMAGE))


def test_bad_flags_are_config_errors_naming_them(tmp_path):
    from cli.serve_cmd import media_sources

    with pytest.raises(ConfigError, match="--allowed-local-media-path .* is not a directory"):
        media_sources(str(tmp_path / "nope"), None, 10.0)
    with pytest.raises(ConfigError, match="--media-fetch-timeout must be positive"):
        media_sources(None, None, 0.0)
    assert media_sources(None, ["a.example, B.example", "c.example"], 5.0).allowed_domains == (
        "a.example",
        "b.example",
        "c.example",
    )


def test_a_fetched_image_reaches_the_engine_as_the_pixels_of_its_data_url(web):
    """Through the real app: the same prompt ids and pixels for the URL and for the inline image;
    a host outside the list is a 400 naming the part, and the engine gets nothing."""
    received = []
    engine = scripted_vision_engine(lambda prompt: "ok")
    generate = engine.generate

    def recording(request_id, prompt_token_ids, params, pooling=None, images=None):
        received.append((list(prompt_token_ids), images))
        return generate(request_id, prompt_token_ids, params, pooling, images)

    engine.generate = recording
    config = ServerConfig(served_model_names=["vlm"], media_sources=MediaSources(allowed_domains=("127.0.0.1",)))

    def chat(url):
        parts = [{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": url}}]
        return {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}

    with TestClient(create_app(engine, config, start_engine=False), base_url="http://127.0.0.1:2000") as http_client:
        assert http_client.post("/v1/chat/completions", json=chat(f"{web}/cat.png")).status_code == 200
        assert http_client.post("/v1/chat/completions", json=chat(data_url(IMAGE))).status_code == 200
        refused = http_client.post("/v1/chat/completions", json=chat("http://192.0.2.1/cat.png"))
    (fetched_ids, fetched), (inline_ids, inline) = received
    assert fetched_ids == inline_ids
    assert [np.array_equal(a.pixel_values, b.pixel_values) for a, b in zip(fetched, inline, strict=True)] == [True]
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "messages[0].content[1]" and "not fetched from '192.0.2.1'" in error["message"]
    assert len(received) == 2
