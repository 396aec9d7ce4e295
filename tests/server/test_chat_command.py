"""``fw chat``: the streaming REPL against a running server (the real app, a scripted model):
replies stream to the terminal, the conversation is kept between turns, /clear forgets it,
and an unreachable server is a clear error."""

from __future__ import annotations

from typer.testing import CliRunner

from cli.main import build_app
from framework.server.app import create_app
from framework.server.state import ServerConfig

from .scripted_engine import ScriptedEngineClient, ThreadedServer


def reply(prompt: str) -> str:
    """How many user turns the prompt holds, so the kept conversation is visible in the answers."""
    return f"<think>counting</think>turns: {prompt.count('<|user|>')}"


def test_chat_streams_replies_and_keeps_the_conversation(free_tcp_port):
    engine = ScriptedEngineClient(reply)
    config = ServerConfig(served_model_names=["scripted"], reasoning_parser="qwen3")
    with ThreadedServer(create_app(engine, config, start_engine=False), free_tcp_port()) as server:
        result = CliRunner().invoke(
            build_app(),
            ["chat", "--url", server.base_url, "--system", "Be brief."],
            input="hi\nagain\n/clear\nonce more\n/exit\n",
        )
    assert result.exit_code == 0, result.output
    assert "fw chat with scripted" in result.output
    assert result.output.count("turns: 1") == 2 and "turns: 2" in result.output  # /clear started over
    assert "counting" in result.output  # the reasoning is shown too
    assert engine.prompts[1].startswith("<|system|>Be brief.<|user|>hi<|assistant|>turns: 1<|user|>again")
    assert engine.prompts[2] == "<|system|>Be brief.<|user|>once more<|assistant|>"


def test_chat_without_a_server_says_how_to_start_one(free_tcp_port):
    result = CliRunner().invoke(build_app(), ["chat", "--url", f"http://127.0.0.1:{free_tcp_port()}"])
    assert result.exit_code == 2 and "fw serve" in result.output
