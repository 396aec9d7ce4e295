"""MCP execution is the operator's choice, and capped per request.

The real app with a scripted model (scripted_engine.py) and a real stdio MCP server
(mcp_server_fixture.py). Without ``--mcp-execute`` or ``"execute": true`` a client's
``mcp_execute`` is a 400 and no tool runs; ``allowed_tools`` limits which tools run; the caps on
calls per round, result bytes and MCP time per request hold.
"""

from __future__ import annotations

import json
import re
import sys

import httpx
import pytest

from framework.server.app import create_app
from framework.server.mcp_client import load_mcp_config, truncate_result
from framework.server.state import ServerConfig

from .scripted_engine import ScriptedEngineClient, ThreadedServer
from .test_mcp_server import FIXTURE

ADD = '<tool_call>\n{"name": "calc__add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'
SHOUT = '<tool_call>\n{"name": "calc__shout", "arguments": {"text": "hello world"}}\n</tool_call>'


def reply(prompt: str) -> str:
    """Until tool results are in the prompt: one add call, or three adds ("three"), or a shout
    ("shout"); then an answer quoting the results. "again": an add call on every round."""
    results = re.findall(r"<\|tool\|>(.*?)(?=<\|tool\||<\|assistant\||$)", prompt, re.S)
    if "<|user|>again" in prompt:  # calls add on every round
        return ADD
    if results:
        return "Results: " + " | ".join(r.strip() for r in results)
    if "<|user|>three" in prompt:
        return ADD + ADD + ADD
    return SHOUT if "<|user|>shout" in prompt else ADD


@pytest.fixture(scope="module")
def server(tmp_path_factory, free_tcp_port):
    """``calc`` without "execute"; the operator's choice is flipped per test on the running app."""
    config_file = tmp_path_factory.mktemp("mcp") / "mcp.json"
    config_file.write_text(json.dumps({"mcpServers": {"calc": {"command": sys.executable, "args": [FIXTURE]}}}))
    engine = ScriptedEngineClient(reply)
    config = ServerConfig(
        served_model_names=["scripted"], tool_parser="qwen", mcp_servers=load_mcp_config(str(config_file))
    )
    app = create_app(engine, config, start_engine=False)
    with ThreadedServer(app, free_tcp_port()) as running:
        running.engine, running.state = engine, app.state.server
        yield running


@pytest.fixture
def calls(server, monkeypatch):
    """The tool calls the MCP manager makes during a test (the real calls still run)."""
    made = []
    manager = server.state.mcp
    real = manager.call_tool

    async def recording(name, arguments, **kwargs):
        made.append(name)
        return await real(name, arguments, **kwargs)

    monkeypatch.setattr(manager, "call_tool", recording)
    return made


def _chat(server, content: str = "add", **extra) -> httpx.Response:
    body = {"model": "scripted", "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)


def _listed(server) -> dict:
    [calc] = httpx.get(server.base_url + "/v1/mcp/servers").json()["data"]
    return calc


def _entry(server) -> dict:
    return server.state.mcp.servers["calc"].entry


@pytest.mark.parametrize("stream", [False, True])
def test_mcp_execute_without_the_operators_consent_is_refused_and_no_tool_runs(server, calls, stream):
    num_prompts = len(server.engine.prompts)
    response = _chat(server, mcp_execute=True, stream=stream)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "mcp_execute_disabled" and error["param"] == "mcp_execute"
    assert "operator" in error["message"] and "--mcp-execute" in error["message"]
    assert calls == [] and len(server.engine.prompts) == num_prompts  # neither the tool nor the model ran
    listed = _listed(server)
    assert listed["tools"] == ["calc__add", "calc__shout"] and listed["execute"] is False
    assert listed["executable_tools"] == []
    # the tools are still offered: the model's call goes back to the client
    plain = _chat(server).json()["choices"][0]
    assert (
        plain["finish_reason"] == "tool_calls" and plain["message"]["tool_calls"][0]["function"]["name"] == "calc__add"
    )
    assert calls == []


def test_the_servers_flag_lets_clients_run_every_tool(server, calls, monkeypatch):
    monkeypatch.setattr(server.state.mcp, "execute_all", True)
    message = _chat(server, mcp_execute=True).json()["choices"][0]["message"]
    assert message["content"] == "Results: 42" and calls == ["calc__add"]
    assert message["mcp_calls"][0]["result"] == "42"
    assert _listed(server)["executable_tools"] == ["calc__add", "calc__shout"]


def test_execute_in_the_config_with_an_allow_list_runs_only_those_tools(server, calls, monkeypatch):
    monkeypatch.setitem(_entry(server), "execute", True)
    monkeypatch.setitem(_entry(server), "allowed_tools", ["shout"])
    assert (_listed(server)["execute"], _listed(server)["executable_tools"]) == (True, ["calc__shout"])
    shouted = _chat(server, "shout", mcp_execute=True).json()["choices"][0]["message"]
    assert shouted["content"] == "Results: HELLO WORLD" and calls == ["calc__shout"]
    not_allowed = _chat(server, "add", mcp_execute=True).json()["choices"][0]
    assert not_allowed["finish_reason"] == "tool_calls" and calls == ["calc__shout"]  # add went back to the client
    assert json.loads(not_allowed["message"]["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 40}


def test_calls_beyond_the_per_round_cap_get_an_error_result(server, calls, monkeypatch):
    monkeypatch.setattr(server.state.mcp, "execute_all", True)
    monkeypatch.setattr(server.state.config, "mcp_max_calls_per_round", 2)
    message = _chat(server, "three", mcp_execute=True).json()["choices"][0]["message"]
    records = message["mcp_calls"]
    assert [(r["result"], r["is_error"]) for r in records[:2]] == [("42", False), ("42", False)]
    assert records[2]["is_error"] and "more than 2 tool calls in one round" in records[2]["result"]
    assert calls == ["calc__add", "calc__add"]
    assert message["content"].startswith("Results: 42 | 42 | not run: more than 2")


def test_a_long_result_is_truncated_with_a_note(server, calls, monkeypatch):
    monkeypatch.setattr(server.state.mcp, "execute_all", True)
    monkeypatch.setattr(server.state.config, "mcp_max_result_bytes", 5)
    [record] = _chat(server, "shout", mcp_execute=True).json()["choices"][0]["message"]["mcp_calls"]
    assert record["result"] == "HELLO\n[truncated: 6 more bytes (--mcp-max-result-bytes 5)]"


def test_calls_after_the_time_budget_is_spent_are_not_run(server, calls, monkeypatch):
    monkeypatch.setattr(server.state.mcp, "execute_all", True)
    monkeypatch.setattr(server.state.config, "mcp_max_time_s", 1e-6)  # less than any call takes
    message = _chat(server, "three", mcp_execute=True).json()["choices"][0]["message"]
    first, *rest = message["mcp_calls"]
    assert first["is_error"] and first["result"] == "calling calc__add took longer than 1e-06 s and was stopped"
    assert [(r["is_error"], r["result"]) for r in rest] == [
        (True, "not run: this request spent its 1e-06 s of MCP tool time (--mcp-max-time)")
    ] * 2
    assert calls == ["calc__add"]


def test_no_round_runs_calls_once_the_time_budget_is_spent(server, calls, monkeypatch):
    monkeypatch.setattr(server.state.mcp, "execute_all", True)
    monkeypatch.setattr(server.state.config, "mcp_max_time_s", 1e-6)
    choice = _chat(server, "again", mcp_execute=True).json()["choices"][0]
    assert len(choice["message"]["mcp_calls"]) == 1 and calls == ["calc__add"]  # the first round's call ran
    assert choice["finish_reason"] == "tool_calls"  # the second round's call went back to the client
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "calc__add"


def test_truncation_keeps_whole_characters():
    assert truncate_result("short", 5) == "short"
    cut = truncate_result("héé", 2)  # 'h' then a 2-byte 'é' that does not fit
    assert cut == "h\n[truncated: 4 more bytes (--mcp-max-result-bytes 2)]"


def test_a_call_is_stopped_when_the_time_left_runs_out():
    import asyncio

    from framework.server.mcp_client import MCPManager

    class SlowSession:
        async def call_tool(self, name, args):
            await asyncio.sleep(30)

    async def run() -> tuple[str, bool]:
        manager = MCPManager({"slow": {"command": "unused"}}, execute_all=True)
        server = manager.servers["slow"]
        server.session, server.tools = SlowSession(), [type("Tool", (), {"name": "wait"})()]
        manager._tools["slow__wait"] = (server, "wait")  # what start() records for a listed tool
        return await manager.call_tool("slow__wait", "{}", timeout_s=0.05)

    result, is_error = asyncio.run(run())
    assert is_error and result == "calling slow__wait took longer than 0.05 s and was stopped"
