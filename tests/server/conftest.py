"""Fixtures that run a real ``fw serve`` process on the tiny random-weight Llama, and the headless
Chromium of the web UI's browser tests.

``start_server(args, base_url)`` starts ``python -m cli.main serve ...``; ``serving(args)`` does that on a free
loopback port, waits for the ready line and stops it on exit. Servers are module-scoped: starting one costs seconds.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from framework.distributed.config import free_port

REPO = Path(__file__).resolve().parents[2]
#: The web UI's browser tests drive Debian's Chromium (Playwright's own browser download is not used).
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
#: Where the browser tests save their screenshots (git-ignored).
WEBUI_ARTIFACTS = REPO / "test-artifacts" / "webui"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def serve_argv() -> list[str]:
    """The real CLI: ``python -m cli.main serve``."""
    return [sys.executable, "-m", "cli.main", "serve"]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    base_url: str
    lines: list[str] = field(default_factory=list)
    _queue: queue.Queue = field(default_factory=queue.Queue)

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            self._queue.put(line)
        self._queue.put(None)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError("fw serve exited before it was ready:\n" + "\n".join(self.lines))
            if line.startswith("fw: ready"):
                return
        raise TimeoutError("fw serve was not ready in time:\n" + "\n".join(self.lines))

    @property
    def engine_pid(self) -> int:
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        assert len(children) == 1, children
        return int(children[0])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(args: list[str], base_url: str) -> ServerProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        serve_argv() + args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    server = ServerProcess(process, base_url)
    threading.Thread(target=server._pump, daemon=True).start()
    return server


@contextmanager
def serving(args: list[str], port: int | None = None) -> Iterator[ServerProcess]:
    """``fw serve --h 127.0.0.1:<port> <args>`` (a free port by default): yields the process once it is ready,
    stops it on exit."""
    port = port or free_port()
    proc = start_server(["--h", f"127.0.0.1:{port}", *args], f"http://127.0.0.1:{port}")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def write_tiny_llama(path: Path, chat_template: str) -> Path:
    """The tiny random-weight Llama (vocabulary ``t<i>``) with ``chat_template``, written to ``path``."""
    import transformers

    from framework.testing import write_tiny_model

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    write_tiny_model(path, config, chat_template=chat_template)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def default_model_server():
    """One ``fw serve`` of the embedded default model on CPU (no other flags), shared by the test
    modules that only need it running."""
    with serving(["--device", "cpu", "--max-model-len", "1024", "--mem", "64"]) as proc:
        yield proc


@pytest.fixture(scope="session")
def launch_fw_server():
    """``launch_fw_server(args, base_url)`` starts ``fw serve`` (not yet ready); stop() it when done."""
    return start_server


@pytest.fixture(scope="session")
def free_tcp_port():
    return free_port


@pytest.fixture(scope="session", name="write_tiny_llama")
def write_tiny_llama_fixture():
    """``write_tiny_llama(path, chat_template)``: the tiny Llama of ``tiny_model_dir`` with another chat template."""
    return write_tiny_llama


@pytest.fixture(scope="session")
def serve_on_free_port():
    """``with serve_on_free_port(args[, port]) as proc:`` a ready ``fw serve`` on a loopback port (see :func:`serving`)."""
    return serving


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (:data:`CHROMIUM`) through Playwright, one per test module."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()
