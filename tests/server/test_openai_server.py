"""A real ``fw serve`` process on a loopback port, driven by the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import openai
import pytest

from framework.testing import metric_value

API_KEYS = ("key-one", "key-two")
MAX_REQUEST_BYTES = 200_000
MESSAGES = [{"role": "user", "content": "t5 t9 t12 t40"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, serve_on_free_port):
    with serve_on_free_port(
        [
            "--m",
            str(tiny_model_dir),
            "--device",
            "cpu",
            "--api-key",
            API_KEYS[0],
            "--api-key",
            API_KEYS[1],
            "--served-model-name",
            "tiny",
            "--max-request-bytes",
            str(MAX_REQUEST_BYTES),
            "--max-num-seqs",
            "64",
            # async scheduling (the GPU default) under every API test here; the
            # other server modules run the CPU default (sync)
            "--async-scheduling",
            # the last test kills the engine: it must stay dead here (restarts:
            # test_engine_supervision.py)
            "--no-engine-restart",
        ]
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEYS[1], max_retries=0)


@pytest.fixture(scope="module")
def aclient_factory(server):
    return lambda: openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEYS[0], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEYS[0]}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from framework.tokenizer import Tokenizer

    return Tokenizer.from_directory(tiny_model_dir)


@pytest.fixture(scope="module")
def reference_llm(tiny_model_dir):
    from framework import LLM

    return LLM(str(tiny_model_dir), device="cpu")


metric = metric_value


# --- startup -----------------------------------------------------------------------------
def test_startup_prints_one_summary_and_a_ready_line_with_the_url(server):
    assert sum(line.startswith("fw 0.") for line in server.lines) == 1
    assert any("KV cache" in line and "blocks" in line for line in server.lines)
    ready = [line for line in server.lines if line.startswith("fw: ready")]
    assert len(ready) == 1 and server.base_url in ready[0]


def test_health_version_and_models(http, server):
    assert http.get("/health").status_code == 200
    assert re.match(r"\d+\.\d+", http.get("/version").json()["version"])
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 256
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"
    missing = http.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


# --- chat and completions through the openai client ----------------------------------------
def test_chat_completion_usage_matches_the_tokenizer(client, tokenizer):
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=7, temperature=0, logprobs=True, extra_body={"ignore_eos": True}
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES))
    assert response.usage.completion_tokens == 7 == len(choice.logprobs.content)
    assert response.usage.total_tokens == response.usage.prompt_tokens + 7
    assert choice.message.content == "".join(
        lp.token if i == 0 else " " + lp.token for i, lp in enumerate(choice.logprobs.content)
    )


def test_streamed_chat_equals_the_non_streamed_chat(client):
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_greedy_completion_equals_llm_generate(client, reference_llm):
    from framework import SamplingParams

    prompt_ids = [5, 9, 12, 40, 77]
    expected = reference_llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=16))
    response = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=16, temperature=0)
    assert response.choices[0].text == expected[0].outputs[0].text
    assert response.usage.completion_tokens == len(expected[0].outputs[0].token_ids)
    assert response.usage.prompt_tokens == len(prompt_ids)


def test_completion_prompt_forms_echo_and_logprobs(client, tokenizer):
    response = client.completions.create(
        model="tiny",
        prompt=["t5 t9", "t7 t8 t9"],
        max_tokens=4,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in response.choices] == [0, 1]
    for choice, prompt in zip(response.choices, ["t5 t9", "t7 t8 t9"], strict=True):
        assert choice.text.startswith(prompt)
        num_prompt = len(tokenizer.encode(prompt))
        assert len(choice.logprobs.tokens) == num_prompt + 4
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.tokens[:num_prompt] == prompt.split()
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
        assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs[num_prompt:])
    assert response.usage.prompt_tokens == 5 and response.usage.completion_tokens == 8
    single = client.completions.create(
        model="tiny", prompt="t5 t9", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].text == "t5 t9" + single.choices[0].text


def test_streamed_completion_equals_the_non_streamed_one(client):
    kwargs = dict(model="tiny", prompt="t3 t4 t5", max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n_2_returns_two_choices_seeded_apart(client):
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, temperature=1.0, n=2, seed=11, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 20
    assert response.choices[0].message.content != response.choices[1].message.content
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=10,
        temperature=1.0,
        n=2,
        seed=11,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in sorted(response.choices, key=lambda c: c.index)]


def test_same_seed_reproduces_and_another_seed_differs(client):
    def sample(seed):
        return (
            client.completions.create(
                model="tiny", prompt="t5 t6", max_tokens=16, temperature=1.0, seed=seed, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_stop_string_cuts_the_text_before_it(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    words = full.split()
    stop = f" {words[3]} {words[4]}"
    assert stop in f" {full}"
    expected = f" {full}"[: f" {full}".index(stop)].lstrip()
    response = client.chat.completions.create(stop=[stop, "never-there"], **kwargs)
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(stop=stop, stream=True, **kwargs)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logit_bias_and_penalties_are_applied(client):
    biased = client.completions.create(
        model="tiny",
        prompt="t5 t6",
        max_tokens=5,
        temperature=0,
        logit_bias={"77": 100},
        extra_body={"ignore_eos": True},
    )
    assert biased.choices[0].text.split() == ["t77"] * 5
    penalized = client.completions.create(
        model="tiny",
        prompt="t5 t6",
        max_tokens=5,
        temperature=0,
        logit_bias={"77": 3},
        frequency_penalty=2.0,
        extra_body={"ignore_eos": True},
    )
    assert penalized.choices[0].text.split() != ["t77"] * 5


def test_chat_template_kwargs_and_max_completion_tokens(client, tokenizer):
    response = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"add_generation_prompt": False}},
    )
    assert response.usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES, add_generation_prompt=False))
    assert response.usage.completion_tokens == 3


def test_tokenize_and_detokenize_round_trip(http, tokenizer):
    tokens = http.post("/tokenize", json={"prompt": "t5 t9 t12"}).json()
    assert tokens["tokens"] == tokenizer.encode("t5 t9 t12") and tokens["count"] == 3
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == tokenizer.encode_chat(MESSAGES)
    assert http.post("/detokenize", json={"tokens": [5, 9, 12]}).json()["prompt"] == "t5 t9 t12"


# --- errors by raw HTTP --------------------------------------------------------------------
def _error(response, status, code, param=...):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    if param is not ...:
        assert error["param"] == param
    return error


def test_malformed_json_is_400(http):
    _error(
        http.post("/v1/chat/completions", content=b'{"messages": [', headers={"Content-Type": "application/json"}),
        400,
        "invalid_json",
    )


def test_wrong_types_are_400_naming_the_field(http):
    _error(
        http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": "many"}),
        400,
        "invalid_type",
        "max_tokens",
    )
    _error(http.post("/v1/chat/completions", json={"messages": "hi"}), 400, "invalid_type", "messages")
    _error(http.post("/v1/chat/completions", json={"model": "tiny"}), 400, "missing_required_parameter", "messages")
    _error(http.post("/v1/completions", json={"prompt": [1.5]}), 400, "invalid_type", "prompt")
    _error(
        http.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": -1}),
        400,
        "invalid_value",
        "temperature",
    )


def test_unsupported_fields_are_rejected_and_unknown_ones_ignored(http):
    _error(
        http.post("/v1/chat/completions", json={"messages": MESSAGES, "functions": [{"name": "f"}]}),
        400,
        "unsupported_parameter",
        "functions",
    )
    _error(
        http.post("/v1/chat/completions", json={"messages": MESSAGES, "modalities": ["audio"]}),
        400,
        "unsupported_parameter",
        "modalities",
    )
    _error(
        http.post("/v1/chat/completions", json={"messages": MESSAGES, "response_format": {"type": "yaml"}}),
        400,
        "invalid_value",
        "response_format.type",
    )
    ok = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "metadata": {"a": "b"}})
    assert ok.status_code == 200


def test_unknown_model_is_404(http):
    _error(
        http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MESSAGES}),
        404,
        "model_not_found",
        "model",
    )


def test_prompt_over_the_context_length_is_400_with_the_numbers(http):
    prompt = " ".join(["t7"] * 250)
    error = _error(
        http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 10}),
        400,
        "context_length_exceeded",
    )
    assert "256" in error["message"] and "250" in error["message"] and "10" in error["message"]
    error = _error(
        http.post("/v1/completions", json={"prompt": " ".join(["t7"] * 300)}), 400, "context_length_exceeded"
    )
    assert "300" in error["message"]


def test_bad_or_missing_api_key_is_401(server):
    for headers in ({"Authorization": "Bearer wrong"}, {}):
        response = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": MESSAGES}, headers=headers)
        _error(response, 401, "invalid_api_key")
    assert httpx.get(server.base_url + "/health").status_code == 200  # health needs no key


def test_a_foreign_pages_requests_are_refused_by_a_real_server(http, server):
    """What a page on another site (or a DNS-rebinding name) can send to fw serve, with the right key even."""
    body = b'{"model": "tiny", "prompt": "t5", "max_tokens": 1}'
    simple = http.post(
        "/v1/completions", content=body, headers={"Content-Type": "text/plain", "Origin": "https://evil.example"}
    )
    _error(simple, 403, "cross_origin_refused")
    _error(
        http.post("/v1/completions", content=body, headers={"Content-Type": "text/plain"}),
        415,
        "unsupported_media_type",
    )
    port = server.base_url.rsplit(":", 1)[1]
    _error(
        http.post(
            "/v1/completions",
            content=body,
            headers={"Content-Type": "application/json", "Host": f"rebind.evil.example:{port}"},
        ),
        421,
        "invalid_host",
    )
    same_origin = http.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json", "Origin": server.base_url}
    )
    assert same_origin.status_code == 200 and same_origin.json()["usage"]["completion_tokens"] == 1


def test_oversized_body_is_413(http):
    response = http.post("/v1/completions", json={"prompt": "t5 " * (MAX_REQUEST_BYTES // 3 + 10)})
    _error(response, 413, "request_too_large")


def test_unknown_route_is_404_in_the_error_envelope(http):
    _error(http.get("/v1/nothing-here"), 404, "not_found")


def test_embeddings_equal_the_engines_pooled_hidden_states(client, reference_llm, tokenizer, http):
    import base64

    import numpy as np

    texts = ["t5 t9 t12", "t3 t4 t5 t6 t7 t8 t9"]
    result = client.embeddings.create(model=client.models.list().data[0].id, input=texts)
    expected = reference_llm.embed([{"prompt_token_ids": tokenizer.encode(t)} for t in texts])
    assert [d.index for d in result.data] == [0, 1]
    for data, vector in zip(result.data, expected):
        assert np.allclose(data.embedding, vector, atol=1e-5)
        assert abs(np.linalg.norm(data.embedding) - 1) < 1e-5
    assert result.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    ids = tokenizer.encode(texts[0])
    raw = http.post("/v1/embeddings", json={"input": [ids], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, expected[0], atol=1e-5)
    last = http.post("/v1/embeddings", json={"input": ids, "pooling": "last"}).json()["data"][0]["embedding"]
    assert np.allclose(last, reference_llm.embed({"prompt_token_ids": ids}, pooling="last")[0], atol=1e-5)
    bad = http.post("/v1/embeddings", json={"input": "t5", "dimensions": 8})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
    empty = http.post("/v1/embeddings", json={"input": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"


# --- concurrency, disconnects, metrics -------------------------------------------------------
def test_64_concurrent_streaming_clients_complete(client, aclient_factory):
    expected = (
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .message.content
    )

    async def one(aclient):
        stream = await aclient.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        text, reason = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main():
        aclient = aclient_factory()
        try:
            return await asyncio.gather(*[one(aclient) for _ in range(64)])
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert results == [(expected, "length")] * 64


def test_disconnected_clients_leave_no_running_requests_or_used_blocks(server, http):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 240, "ignore_eos": True}

    async def streaming(c):
        async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data:")
                if seen >= 3:
                    return  # leaving the block closes the connection mid-stream

    async def main():
        headers = {"Authorization": f"Bearer {API_KEYS[0]}"}
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=60) as c:
            # non-streaming clients hang up once the streaming ones have left: cancelling the
            # task closes its connection while the engine is still decoding its 240 tokens
            waiting = [asyncio.create_task(c.post("/v1/chat/completions", json=body)) for _ in range(4)]
            await asyncio.gather(*[streaming(c) for _ in range(32)])
            assert not any(task.done() for task in waiting), "a 240-token request finished before 3 streamed tokens"
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)

    generated_before = metric(http.get("/metrics").text, "fw:generation_tokens_total")
    asyncio.run(main())
    deadline = time.monotonic() + 15
    while True:
        text = http.get("/metrics").text
        values = [
            metric(text, "fw:num_requests_running"),
            metric(text, "fw:num_requests_waiting"),
            metric(text, "fw:num_kv_blocks_used"),
        ]
        if values == [0, 0, 0] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert values == [0, 0, 0]
    # the engine stopped early: far fewer than 36 x 200 tokens were generated
    assert metric(text, "fw:generation_tokens_total") - generated_before < 36 * 240 / 2


def test_metrics_report_engine_counters_and_latency_histograms(http):
    long_prompt = " ".join(f"t{i}" for i in range(2, 42))  # 40 tokens: two full KV blocks to share
    for _ in range(2):
        assert http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 2}).status_code == 200
    text = http.get("/metrics").text
    assert metric(text, "fw:prompt_tokens_total") > 0 and metric(text, "fw:generation_tokens_total") > 0
    assert metric(text, "fw:prefix_cache_queries_total") >= metric(text, "fw:prefix_cache_hits_total") > 0
    assert metric(text, "fw:num_kv_blocks") > 0 and metric(text, "fw:num_preemptions_total") == 0
    for name in ("fw:time_to_first_token_seconds", "fw:inter_token_latency_seconds", "fw:e2e_request_latency_seconds"):
        assert metric(text, f"{name}_count") > 0


# --- last: the engine process dies -----------------------------------------------------------
def test_engine_death_fails_waiting_clients_and_health(server, http):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 240, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data:"):
                break
        os.kill(server.engine_pid, signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    assert '"error"' in rest[-2] and "engine" in rest[-2]
    deadline = time.monotonic() + 10
    while http.get("/health").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert http.get("/health").status_code == 503
    _error(http.post("/v1/chat/completions", json={"messages": MESSAGES}), 503, "engine_dead")
