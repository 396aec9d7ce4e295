"""MCP tools through the server: a real stdio MCP server (tests/server/mcp_server_fixture.py, the
official SDK) is started by the app, its tools are listed, offered to the model, called by the
server with ``mcp_execute`` and their results fed back. The model is scripted (see
scripted_engine.py) so that it calls the tool and then answers with the result it reads in its prompt.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from framework.server.app import create_app
from framework.server.state import ServerConfig

from .scripted_engine import ScriptedEngineClient, ThreadedServer

FIXTURE = str(Path(__file__).with_name("mcp_server_fixture.py"))
CALL = '<tool_call>\n{"name": "calc__add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'


def scripted_reply(prompt: str) -> str:
    """Call a tool (calc__add; web__shout when asked to shout) until a tool result is in the
    prompt; then answer with that result."""
    results = re.findall(r"<\|tool\|>(.*?)(?=<\||\n|$)", prompt)
    asked_to_shout = "<|user|>shout" in prompt
    if results:
        return f"Shouted: {results[-1]}" if asked_to_shout else f"The sum is {results[-1]}."
    if asked_to_shout:
        return '<tool_call>{"name": "web__shout", "arguments": {"text": "hello"}}</tool_call>'
    return "Let me add.\n" + CALL


def wait_for_port(port: int, process: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the HTTP MCP server exited with {process.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError("the HTTP MCP server did not start")


@pytest.fixture(scope="module")
def http_mcp_url(free_tcp_port):
    port = free_tcp_port()
    process = subprocess.Popen(
        [sys.executable, FIXTURE, "--http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for_port(port, process)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory, free_tcp_port, http_mcp_url):
    config_file = tmp_path_factory.mktemp("mcp") / "mcp.json"
    config_file.write_text(
        json.dumps(
            {
                "mcpServers": {
                    "calc": {"command": sys.executable, "args": [FIXTURE]},
                    "web": {"url": http_mcp_url},
                    "broken": {"command": sys.executable, "args": ["-c", "import sys; sys.exit(3)"]},
                }
            }
        )
    )
    from framework.server.mcp_client import load_mcp_config

    engine = ScriptedEngineClient(scripted_reply)
    config = ServerConfig(
        served_model_names=["scripted"],
        tool_parser="qwen",
        mcp_servers=load_mcp_config(str(config_file)),
        mcp_execute=True,
    )
    with ThreadedServer(create_app(engine, config, start_engine=False), free_tcp_port()) as running:
        running.engine = engine
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "What is 2 + 40?"}]


def test_servers_are_listed_with_their_tools_and_a_failed_one_with_its_error(server):
    servers = {s["name"]: s for s in httpx.get(server.base_url + "/v1/mcp/servers").json()["data"]}
    assert servers["calc"]["status"] == "ok" and servers["calc"]["transport"] == "stdio"
    assert sorted(servers["calc"]["tools"]) == ["calc__add", "calc__shout"]
    assert servers["web"]["status"] == "ok" and servers["web"]["transport"] == "streamable-http"
    assert sorted(servers["web"]["tools"]) == ["web__add", "web__shout"]
    assert servers["broken"]["status"] == "error" and servers["broken"]["error"] and not servers["broken"]["tools"]


def test_mcp_tools_are_offered_and_calls_returned_to_the_client(client, server):
    response = client.chat.completions.create(model="scripted", messages=MESSAGES)
    prompt = server.engine.prompts[-1]
    offered = json.loads(prompt[prompt.index("<tools>") + 7 : prompt.index("</tools>")])
    assert [t["function"]["name"] for t in offered] == ["calc__add", "calc__shout", "web__add", "web__shout"]
    assert offered[0]["function"]["parameters"]["properties"]["a"]["type"] == "integer"
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("calc__add", {"a": 2, "b": 40})


def test_streamed_tool_call_deltas_assemble_to_the_non_streamed_call(client):
    chunks = list(client.chat.completions.create(model="scripted", messages=MESSAGES, stream=True))
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "calc__add" and pieces[0].type == "function"
    assert all(p.index == 0 and p.function.name is None for p in pieces[1:]) and len(pieces) > 2
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == {"a": 2, "b": 40}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me add."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_mcp_execute_runs_the_tool_and_continues_with_its_result(client, server):
    response = client.chat.completions.create(model="scripted", messages=MESSAGES, extra_body={"mcp_execute": True})
    message = response.choices[0].message
    assert message.content == "Let me add.\n\nThe sum is 42." and not message.tool_calls
    [record] = message.model_extra["mcp_calls"]
    assert record["name"] == "calc__add" and json.loads(record["arguments"]) == {"a": 2, "b": 40}
    assert record["result"] == "42" and record["is_error"] is False
    assert response.choices[0].finish_reason == "stop"
    assert '"calc__add"' in server.engine.prompts[-1] and "<|tool|>42" in server.engine.prompts[-1]


def test_streamed_mcp_execute_streams_each_round_and_the_calls_between(client, server):
    chunks = list(
        client.chat.completions.create(
            model="scripted",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"mcp_execute": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Let me add.\n\nThe sum is 42."
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    [records] = [
        c.choices[0].delta.model_extra["mcp_calls"]
        for c in chunks
        if c.choices and c.choices[0].delta.model_extra.get("mcp_calls")
    ]
    assert [(r["name"], r["result"]) for r in records] == [("calc__add", "42")]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].usage.prompt_tokens > 0 and chunks[-1].usage.completion_tokens == sum(
        len(server.engine.tokenizer.encode(t, add_special_tokens=False))
        for t in ("Let me add.\n" + CALL, "The sum is 42.")
    )


@pytest.mark.parametrize("stream", [False, True])
def test_cached_prompt_tokens_add_up_over_rounds_as_prompt_tokens_do(client, server, monkeypatch, stream):
    monkeypatch.setattr(server.engine, "cached_tokens", lambda num_prompt_tokens: num_prompt_tokens // 2)
    first = len(server.engine.prompt_lengths)
    response = client.chat.completions.create(
        model="scripted",
        messages=MESSAGES,
        stream=stream,
        extra_body={"mcp_execute": True},
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    usage = list(response)[-1].usage if stream else response.usage
    rounds = server.engine.prompt_lengths[first:]
    assert len(rounds) == 2  # the tool call, then the answer with its result
    assert usage.prompt_tokens == sum(rounds)
    assert usage.prompt_tokens_details.cached_tokens == sum(n // 2 for n in rounds)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_are_templated_once_per_request_over_all_rounds(client, monkeypatch, stream):
    """The conversation is converted for the template once (each MCP round appends to it)."""
    from framework.server import serving_chat

    calls = []
    original = serving_chat.template_messages
    monkeypatch.setattr(
        serving_chat, "template_messages", lambda messages, **kw: calls.append(1) or original(messages, **kw)
    )
    response = client.chat.completions.create(
        model="scripted", messages=MESSAGES, stream=stream, extra_body={"mcp_execute": True}
    )
    text = (
        "".join(c.choices[0].delta.content or "" for c in response if c.choices)
        if stream
        else response.choices[0].message.content
    )
    assert text == "Let me add.\n\nThe sum is 42." and len(calls) == 1


def test_streamed_mcp_execute_sends_calls_it_cannot_run_whole(client):
    tools = [{"type": "function", "function": {"name": "calc__add", "parameters": {"type": "object"}}}]
    chunks = list(
        client.chat.completions.create(
            model="scripted",
            messages=MESSAGES,
            stream=True,
            tools=tools,
            tool_choice="auto",
            extra_body={"mcp_execute": True, "mcp_max_rounds": 0},
        )
    )
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(pieces) == 1 and pieces[0].function.name == "calc__add"
    assert json.loads(pieces[0].function.arguments) == {"a": 2, "b": 40}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_request_tools_replace_the_mcp_tools(client, server):
    tools = [{"type": "function", "function": {"name": "calc__add", "parameters": {"type": "object"}}}]
    client.chat.completions.create(model="scripted", messages=MESSAGES, tools=tools)
    prompt = server.engine.prompts[-1]
    assert json.loads(prompt[prompt.index("<tools>") + 7 : prompt.index("</tools>")]) == tools


def test_tool_choice_none_offers_no_mcp_tools(client, server):
    response = client.chat.completions.create(model="scripted", messages=MESSAGES, tool_choice="none")
    assert "<tools>" not in server.engine.prompts[-1]
    assert response.choices[0].message.tool_calls is None and CALL in response.choices[0].message.content


def test_mcp_execute_through_a_streamable_http_server(client):
    response = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "shout hello"}], extra_body={"mcp_execute": True}
    )
    assert response.choices[0].message.content == "Shouted: HELLO"
    [record] = response.choices[0].message.model_extra["mcp_calls"]
    assert (record["name"], record["result"]) == ("web__shout", "HELLO")


def test_mcp_config_forms_and_errors(tmp_path):
    from framework.errors import ConfigError
    from framework.server.mcp_client import load_mcp_config

    assert load_mcp_config(None, "python", "server.py --flag 'a b'") == {
        "mcp": {"command": "python", "args": ["server.py", "--flag", "a b"]}
    }
    assert load_mcp_config(None) is None
    bad = tmp_path / "bad.json"
    for content, message in [
        ("{", "not valid JSON"),
        ('{"servers": {}}', "mcpServers"),
        ('{"mcpServers": {"x": {"command": "a", "url": "b"}}}', "exactly one of"),
        ('{"mcpServers": {"a__b": {"command": "a"}}}', "server name"),
        ('{"mcpServers": {"a": {"command": "a", "execute": "yes"}}}', '"execute" must be'),
        ('{"mcpServers": {"a": {"command": "a", "allowed_tools": "add"}}}', "allowed_tools"),
    ]:
        bad.write_text(content)
        with pytest.raises(ConfigError, match=message):
            load_mcp_config(str(bad))
    with pytest.raises(ConfigError, match="needs --mcp-command"):
        load_mcp_config(None, None, "x")


def test_the_openai_tool_list_is_built_once_per_listing():
    """Requests share one tool list, built when the servers' tools are listed, not per request."""
    import asyncio

    from framework.server.mcp_client import MCPManager

    async def run():
        manager = MCPManager({"calc": {"command": sys.executable, "args": [FIXTURE]}})
        assert manager.openai_tools() == []  # nothing listed yet
        await manager.start()
        try:
            tools = manager.openai_tools()
            assert [t["function"]["name"] for t in tools] == ["calc__add", "calc__shout"]
            assert tools[0]["function"]["parameters"]["properties"]["a"]["type"] == "integer"
            assert manager.openai_tools() is tools
        finally:
            await manager.close()

    asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True])
def test_responses_api_runs_mcp_tools_and_returns_mcp_call_items(server, stream):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kwargs = dict(model="scripted", input="What is 2 + 40?", extra_body={"mcp_execute": True})
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        response = events[-1].response
        assert [e.item.type for e in events if e.type == "response.output_item.added"] == [
            "message",
            "mcp_call",
            "message",
        ]
    else:
        response = client.responses.create(**kwargs)
    [ran] = [item for item in response.output if item.type == "mcp_call"]
    assert (ran.name, ran.server_label, json.loads(ran.arguments), ran.output) == (
        "calc__add",
        "calc",
        {"a": 2, "b": 40},
        "42",
    )
    assert "The sum is 42." in response.output_text
    # a follow-up sees the call the server ran and its result
    client.responses.create(model="scripted", input="thanks", previous_response_id=response.id)
    assert "<|tool|>42" in server.engine.prompts[-1]


def test_messages_api_runs_mcp_tools_and_returns_mcp_blocks(server):
    import anthropic

    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    message = client.messages.create(
        model="scripted", max_tokens=200, messages=MESSAGES, extra_body={"mcp_execute": True}
    )
    kinds = [block.type for block in message.content]
    assert kinds == ["mcp_tool_use", "mcp_tool_result", "text"], kinds
    use, result, text = message.content
    assert (use.name, use.server_name, use.input) == ("calc__add", "calc", {"a": 2, "b": 40})
    assert result.content[0]["text"] == "42" and text.text.endswith("The sum is 42.")  # a beta block: a dict here
    assert message.stop_reason == "end_turn"
