"""Bounded requests and validation before the engine: every breach is a 4xx naming the field, fast.

The app runs in process with the scripted engine (a real byte-level tokenizer); a request that
got through would reach ``engine.prompts``, so each refusal also checks the engine saw nothing.
"""

from __future__ import annotations

import json
import random
import socket
import time

import httpx
import pytest
from litestar.testing import TestClient

from framework.server.app import create_app
from framework.server.errors import json_depth
from framework.server.limits import MAX_GRAMMAR_CHARS
from framework.server.state import ServerConfig

from .scripted_engine import ScriptedEngineClient, ThreadedServer

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def _client(**config) -> tuple[TestClient, ScriptedEngineClient]:
    engine = ScriptedEngineClient(lambda prompt: "ok")
    app = create_app(engine, ServerConfig(served_model_names=["m"], **config), start_engine=False)
    return TestClient(app, base_url="http://127.0.0.1:2000"), engine  # a loopback Host


@pytest.fixture
def http():
    client, engine = _client()
    with client:
        client.engine = engine
        yield client


def _refused(response: httpx.Response, param: str | None, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error


def test_huge_n_is_a_fast_400(http):
    start = time.perf_counter()
    response = http.post(CHAT, json={"messages": MESSAGES, "n": 1180591620717411303424})
    assert time.perf_counter() - start < 1.0
    assert "[1, 128]" in _refused(response, "n")["message"]
    _refused(http.post("/v1/completions", json={"prompt": "x", "n": 129}), "n")
    assert http.post("/v1/completions", json={"prompt": "x", "n": 128}).status_code == 200
    assert http.engine.prompt_lengths.count(1) == 128


def test_max_n_is_the_servers_choice():
    client, _ = _client(max_n=2)
    with client:
        _refused(client.post(CHAT, json={"messages": MESSAGES, "n": 3}), "n")
        assert len(client.post(CHAT, json={"messages": MESSAGES, "n": 2}).json()["choices"]) == 2


@pytest.mark.parametrize(
    "field, value",
    [
        ("seed", 2**70),
        ("seed", -(2**63) - 1),
        ("top_k", 2**40),
        ("top_k", -2),
        ("max_tokens", 2**70),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("min_tokens", 2**64),
        ("logprobs", 2**70),
    ],
)
def test_integer_fields_out_of_range_are_400(http, field, value):
    body = {"prompt": "x", field: value}
    response = http.post("/v1/completions", json=body)
    _refused(response, field)
    assert http.engine.prompts == []


def test_largest_seed_and_negative_seed_work(http):
    for seed in (2**63 - 1, -(2**63)):
        response = http.post(CHAT, json={"messages": MESSAGES, "seed": seed, "n": 2})
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("prompt", [[-1], [0, 2**70], [[1, 2], [-5]]])
def test_prompt_token_ids_outside_the_vocabulary_are_400(http, prompt):
    for echo in (False, True):
        response = http.post("/v1/completions", json={"prompt": prompt, "echo": echo})
        assert "token ids must be in [0, " in _refused(response, "prompt")["message"]
    response = http.post("/v1/embeddings", json={"input": prompt})
    assert "input token ids must be in" in _refused(response, "input")["message"]
    assert http.engine.prompts == []


def test_prompts_and_embedding_inputs_are_capped():
    client, engine = _client(max_prompts=3, max_embedding_inputs=2)
    with client:
        assert (
            "--max-prompts" in _refused(client.post("/v1/completions", json={"prompt": ["a"] * 4}), "prompt")["message"]
        )
        assert len(client.post("/v1/completions", json={"prompt": ["a"] * 3}).json()["choices"]) == 3
        error = _refused(client.post("/v1/embeddings", json={"input": ["a", "b", "c"]}), "input")
        assert "--max-embedding-inputs" in error["message"]
        assert len(client.post("/v1/embeddings", json={"input": ["a", "b"]}).json()["data"]) == 2


def test_stop_strings_are_capped_in_number_and_length(http):
    _refused(http.post(CHAT, json={"messages": MESSAGES, "stop": [f"s{i}" for i in range(17)]}), "stop")
    _refused(http.post(CHAT, json={"messages": MESSAGES, "stop": "x" * 257}), "stop")
    _refused(http.post(CHAT, json={"messages": MESSAGES, "stop_token_ids": list(range(17))}), "stop_token_ids")
    assert http.engine.prompts == []
    ok = http.post(CHAT, json={"messages": MESSAGES, "stop": [f"s{i}" for i in range(15)] + ["x" * 256]})
    assert ok.status_code == 200


@pytest.mark.parametrize("depth", [65, 5000, 200_000])
def test_deeply_nested_json_is_400_naming_the_problem(http, depth):
    body = (
        '{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
        + "[" * depth
        + "]" * depth
        + "}}"
    )
    response = http.post(CHAT, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    assert "nested" in response.json()["error"]["message"]


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs"])
def test_a_schema_given_as_text_nested_too_deep_is_400_not_500(http, field):
    schema = "[" * 50_000 + "]" * 50_000  # inside a string: the body's own depth check cannot see it
    value = {"json": schema} if field == "structured_outputs" else schema
    response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value})
    assert response.status_code == 400, response.text
    assert "nested" in response.json()["error"]["message"] and http.engine.prompts == []


def test_json_depth_counts_nesting_and_skips_strings_with_escapes():
    def depth(value) -> int:
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        return 0 if children is None else 1 + max(map(depth, children), default=0)

    def build(level: int):
        choice = rng.random()
        if level > 6 or choice < 0.3:
            return "".join(rng.choice(["[", "]", "{", "}", "\\", '"', "a"]) for _ in range(rng.randint(0, 6)))
        if choice < 0.65:
            return [build(level + 1) for _ in range(rng.randint(0, 3))]
        return {build(7): build(level + 1) for _ in range(rng.randint(0, 3))}

    rng = random.Random(0)
    for _ in range(2000):
        value = build(0)
        assert json_depth(json.dumps(value).encode()) == depth(value), value


def test_nesting_within_the_limit_and_brackets_in_strings_pass(http):
    content = "[" * 100 + "{"  # brackets inside a string are text, not nesting
    body = (
        '{"messages": [{"role": "user", "content": "'
        + content
        + '"}], "chat_template_kwargs": {"a": '
        + "[" * 60
        + "]" * 60
        + "}}"
    )
    response = http.post(CHAT, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    assert content in http.engine.prompts[-1]


@pytest.mark.parametrize(
    "field, value",
    [
        ("continue_final_message", True),
        ("prompt_logprobs", 1),
        ("use_beam_search", True),
        ("priority", 5),
        ("length_penalty", 0.5),
        ("truncate_prompt_tokens", 10),
        ("allowed_token_ids", [1]),
        ("bad_words", ["x"]),
        ("return_tokens_as_token_ids", True),
        ("guided_decoding_backend", "outlines"),
        ("add_special_tokens", True),
        ("echo", True),
        ("chat_template", "{{ messages }}"),
        ("documents", [{"a": "b"}]),
    ],
)
def test_chat_fields_fw_does_not_implement_are_refused(http, field, value):
    error = _refused(http.post(CHAT, json={"messages": MESSAGES, field: value}), field)
    assert error["code"] == "unsupported_parameter"
    assert http.engine.prompts == []


@pytest.mark.parametrize(
    "field, value",
    [
        ("use_beam_search", False),
        ("priority", 0),
        ("continue_final_message", False),
        ("length_penalty", 1),
        ("echo", False),
    ],
)
def test_refused_fields_at_their_default_are_accepted(http, field, value):
    assert http.post(CHAT, json={"messages": MESSAGES, field: value}).status_code == 200


def test_completion_fields_and_continuous_usage_are_refused(http):
    for field, value in (("prompt_logprobs", 2), ("use_beam_search", True), ("priority", 1)):
        _refused(http.post("/v1/completions", json={"prompt": "x", field: value}), field)
    body = {"messages": MESSAGES, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    _refused(http.post(CHAT, json=body), "stream_options.continuous_usage_stats")


def test_structured_outputs_larger_than_the_limit_are_400(http):
    big = "a" * (MAX_GRAMMAR_CHARS + 1)
    _refused(http.post("/v1/completions", json={"prompt": "x", "guided_regex": big}), "guided_regex")
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    response = http.post(
        CHAT,
        json={
            "messages": MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        },
    )
    _refused(response, "response_format.json_schema.schema")
    _refused(
        http.post(CHAT, json={"messages": MESSAGES, "structured_outputs": {"grammar": big}}),
        "structured_outputs.grammar",
    )
    assert http.engine.prompts == []


def test_queue_caps_are_finite_by_default():
    config = ServerConfig()
    assert config.max_queued_requests is not None and config.max_queued_tokens is not None
    client, _ = _client()
    with client:
        state = client.app.state.server
        state.num_admitted = config.max_num_seqs + config.max_queued_requests
        response = client.post(CHAT, json={"messages": MESSAGES})
        assert response.status_code == 429 and "--max-queued-requests" in response.json()["error"]["message"]


def test_a_slow_body_is_408_and_the_server_keeps_answering(free_tcp_port):
    engine = ScriptedEngineClient(lambda prompt: "ok")
    app = create_app(engine, ServerConfig(request_body_timeout_s=0.5), start_engine=False)
    port = free_tcp_port()
    with ThreadedServer(app, port) as server, socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
        start = time.perf_counter()
        slow.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"messages": '
        )  # and never the rest
        assert httpx.get(server.base_url + "/health").status_code == 200
        reply = b""
        while b"request_timeout" not in reply and time.perf_counter() - start < 5:
            chunk = slow.recv(65536)  # the headers and the body may come in separate segments
            if not chunk:
                break
            reply += chunk
        reply = reply.decode()
        assert time.perf_counter() - start < 5
        assert reply.startswith("HTTP/1.1 408") and '"request_timeout"' in reply, reply
        assert engine.prompts == []
