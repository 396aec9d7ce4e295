"""Fuzz the API: hypothesis-built bodies (typed fields, wrong types, huge numbers, special-token
text, deep nesting, broken JSON) on every POST endpoint, against the app with the scripted engine.

Whatever the body, the answer is below 500 (streams carry no internal error event), the server
still answers afterwards, and nothing leaks: no engine request left running, no admission held.
Bounded in time (a few hundred requests, derandomized so a run is reproducible).
"""

from __future__ import annotations

import json
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar.testing import TestClient

from framework.server.anthropic_input import MessagesRequest
from framework.server.app import create_app
from framework.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from framework.server.responses_input import ResponsesRequest
from framework.server.state import ServerConfig

from .scripted_engine import ScriptedEngineClient

SPECIAL = ["<eos>", "<|im_start|>", "<|im_end|>", "<tool_call>", "\ue000fw0\ue001"]
BIG_INTS = [-(2**63) - 1, -1, 0, 1, 2, 127, 128, 129, 2**31, 2**63 - 1, 2**63, 2**64, 2**70, 10**21]

texts = st.one_of(
    st.text(max_size=20),
    st.sampled_from(SPECIAL),
    st.lists(st.sampled_from(["a", " ", "\n", *SPECIAL]), max_size=6).map("".join),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(BIG_INTS),
    st.integers(-300, 300),
    st.floats(allow_nan=False, allow_infinity=False),
    texts,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12,
)
token_ids = st.lists(st.one_of(st.integers(0, 260), st.sampled_from(BIG_INTS)), min_size=0, max_size=6)
#: Anthropic content blocks and Responses input items (some of each valid kind, some not).
blocks = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            ["text", "tool_use", "tool_result", "thinking", "mcp_tool_use", "mcp_tool_result", "image"]
        )
    },
    optional={
        "text": texts,
        "id": texts,
        "name": texts,
        "input": json_values,
        "tool_use_id": texts,
        "content": st.one_of(texts, json_values),
        "thinking": texts,
        "is_error": st.booleans(),
    },
)
items = st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "mcp_call", "x"])},
    optional={
        "role": st.sampled_from(["user", "assistant", "developer", "tool"]),
        "content": st.one_of(texts, json_values),
        "call_id": texts,
        "name": texts,
        "arguments": st.one_of(texts, json_values),
        "id": texts,
        "output": st.one_of(texts, json_values),
        "error": json_values,
    },
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "bot"])},
        optional={
            "content": st.one_of(
                texts,
                st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2),
                st.lists(blocks, max_size=3),
                json_values,
            ),
            "name": texts,
            "tool_call_id": texts,
        },
    ),
    min_size=1,
    max_size=3,
)

#: Typed values for the fields that steer a request, so many bodies get past validation.
TYPED = {
    "messages": messages,
    "prompt": st.one_of(texts, token_ids, st.lists(texts, max_size=3), st.lists(token_ids, max_size=3)),
    "input": st.one_of(texts, token_ids, st.lists(texts, max_size=3), st.lists(items, max_size=4)),
    # a background response goes on after its answer: the checks below look for idle engines
    "background": st.just(False),
    "max_tokens": st.one_of(st.integers(-2, 40), st.sampled_from(BIG_INTS)),
    "n": st.sampled_from(BIG_INTS),
    "stop": st.one_of(texts, st.lists(texts, max_size=20)),
    "stream": st.booleans(),
    "response_format": st.one_of(st.just({"type": "json_object"}), json_values),
    "guided_regex": texts,
    "guided_choice": st.lists(texts, max_size=3),
    "tokens": token_ids,
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25)),
    "top_logprobs": st.integers(-1, 25),
    "stream_options": st.just({"include_usage": True}),
    "mcp_execute": st.booleans(),
    "model": st.sampled_from(["m", "other"]),
}


def typed(kind: msgspec.inspect.Type) -> st.SearchStrategy:
    """Values of the msgspec type ``kind``, edge cases included (huge integers, special-token text)."""
    mi = msgspec.inspect
    if isinstance(kind, mi.UnionType):
        return st.one_of([typed(t) for t in kind.types])
    if isinstance(kind, mi.IntType):
        return st.one_of(st.integers(-3, 40), st.sampled_from(BIG_INTS))
    if isinstance(kind, mi.FloatType):
        return st.one_of(st.floats(-3, 3), st.floats(allow_nan=False, allow_infinity=False))
    if isinstance(kind, mi.ListType):
        return st.lists(typed(kind.item_type), max_size=4)
    if isinstance(kind, mi.DictType):
        return st.dictionaries(texts, typed(kind.value_type), max_size=3)
    if isinstance(kind, mi.LiteralType):
        return st.sampled_from(kind.values)
    if isinstance(kind, mi.StructType):
        return st.fixed_dictionaries(
            {f.encode_name: typed(f.type) for f in kind.fields if f.required},
            optional={f.encode_name: typed(f.type) for f in kind.fields if not f.required},
        )
    return {mi.BoolType: st.booleans(), mi.StrType: texts, mi.NoneType: st.none()}.get(type(kind), json_values)


def bodies(struct: type[msgspec.Struct]) -> st.SearchStrategy[dict]:
    """Dicts over ``struct``'s fields: the required ones always, a few others; values mostly of the
    field's type (or the steering values of :data:`TYPED`), sometimes anything JSON."""
    info = msgspec.inspect.type_info(struct)

    def value(field: msgspec.inspect.Field) -> st.SearchStrategy:
        return st.one_of(
            TYPED.get(field.name, typed(field.type)),
            TYPED.get(field.name, typed(field.type)),
            TYPED.get(field.name, typed(field.type)),
            json_values,
        )

    required = {f.name: TYPED.get(f.name, typed(f.type)) for f in info.fields if f.required}
    optional = [f for f in info.fields if not f.required]
    return st.lists(st.sampled_from(optional), unique_by=lambda f: f.name, max_size=4).flatmap(
        lambda chosen: st.fixed_dictionaries({**required, **{f.name: value(f) for f in chosen}})
    )


ENDPOINTS = {
    "/v1/chat/completions": bodies(ChatCompletionRequest),
    "/v1/completions": bodies(CompletionRequest),
    "/v1/embeddings": bodies(EmbeddingRequest),
    "/v1/responses": bodies(ResponsesRequest),
    "/v1/messages": bodies(MessagesRequest),
    "/v1/messages/count_tokens": bodies(MessagesRequest),
    "/tokenize": bodies(TokenizeRequest),
    "/detokenize": bodies(DetokenizeRequest),
}


def raw_body(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode()


requests = st.sampled_from(sorted(ENDPOINTS)).flatmap(
    lambda path: st.tuples(
        st.just(path),
        st.one_of(
            ENDPOINTS[path].map(raw_body),
            ENDPOINTS[path].map(raw_body),
            ENDPOINTS[path].map(raw_body),
            st.binary(max_size=40),
            st.integers(60, 3000).map(lambda depth: b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"),
            json_values.map(raw_body),
        ),
    )
)


@pytest.fixture(scope="module")
def fuzzed():
    engine = ScriptedEngineClient(lambda prompt: "fine, thanks")
    engine.tokenizer.backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    engine.ready.vocab_size = engine.tokenizer.vocab_size
    app = create_app(engine, ServerConfig(served_model_names=["m"], max_n=4, max_prompts=4), start_engine=False)
    with TestClient(app, base_url="http://127.0.0.1:2000") as http:  # a loopback Host
        yield http, engine, app.state.server


@settings(max_examples=1000, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(request=requests)
def test_no_body_makes_the_server_fail(fuzzed, request):
    http, engine, state = fuzzed
    path, body = request
    response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (path, body[:300], response.text[:500])
    assert "internal_server_error" not in response.text, (path, body[:300], response.text[:500])
    assert engine.active == set(), (path, body[:300])
    assert (state.num_admitted, state.num_admitted_tokens) == (0, 0), (path, body[:300])


def test_the_server_answers_after_the_fuzzing(fuzzed):
    http, engine, state = fuzzed
    start = time.perf_counter()
    assert http.get("/health").json()["status"] == "ok"
    reply = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert reply.json()["choices"][0]["message"]["content"] == "fine, thanks"
    assert time.perf_counter() - start < 5
    assert engine.active == set() and state.num_admitted == 0


def _short(body: bytes) -> bytes:
    """Keep fuzzed generations on the real model short: a valid ``max_tokens`` becomes 2."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if isinstance(value, dict):
        if isinstance(value.get("max_tokens"), int) and value["max_tokens"] > 2:
            value["max_tokens"] = 2
        value.pop("max_completion_tokens", None)
        value.setdefault("max_tokens", 2)
        try:
            return raw_body(value)
        except RecursionError:  # nested too deep to re-encode: sent as it is (the server refuses it)
            return body
    return body


def _blocks_in_use(base_url: str) -> float:
    import httpx

    metrics = httpx.get(base_url + "/metrics", timeout=30).text
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("fw:num_kv_blocks_used"))


def test_the_real_default_model_survives_fuzzing_and_frees_its_blocks(default_model_server):
    """The same bodies against ``fw serve`` of the default model: the engine process sees what
    passed validation (msgpack, vocabulary, grammars); afterwards no KV block is referenced."""
    import httpx

    base = default_model_server.base_url
    with httpx.Client(base_url=base, timeout=120) as http:
        for body in (
            b'{"messages": [{"role": "user", "content": "x"}], "seed": 1180591620717411303424}',
            b'{"prompt": [-1]}',
            b'{"prompt": [1], "echo": true, "logprobs": 1, "seed": -1}',
        ):
            response = http.post(
                "/v1/completions" if b"prompt" in body else "/v1/chat/completions",
                content=body,
                headers={"Content-Type": "application/json"},
            )
            assert response.status_code < 500, response.text

        @settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(request=requests)
        def fuzz(request):
            path, body = request
            response = http.post(path, content=_short(body), headers={"Content-Type": "application/json"})
            assert response.status_code < 500, (path, body[:300], response.text[:500])
            assert "internal_server_error" not in response.text, (path, body[:300], response.text[:500])

        fuzz()
        start = time.perf_counter()
        huge = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 10**9})
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "n"
        assert time.perf_counter() - start < 1.0
        assert http.get("/health").json()["status"] == "ok"
        deadline = time.monotonic() + 10
        while _blocks_in_use(base) and time.monotonic() < deadline:  # aborts reach the engine asynchronously
            time.sleep(0.2)
        assert _blocks_in_use(base) == 0
