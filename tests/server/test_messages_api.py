"""The Anthropic Messages API (``/v1/messages``) driven by the official ``anthropic`` SDK against the
real app, its "model" scripted (scripted_engine.py) to think, call a tool and answer with its
result: content blocks, the event stream, the tool round trip, stop sequences, count_tokens,
x-api-key auth and Anthropic's error envelope.
"""

from __future__ import annotations

import re

import anthropic
import httpx
import pytest

from framework.server.app import create_app
from framework.server.state import ServerConfig

from .scripted_engine import ScriptedEngineClient, ThreadedServer

KEY = "sk-test-key"
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def scripted_reply(prompt: str) -> str:
    results = re.findall(r"<\|tool\|>(.*?)(?=<\||$)", prompt)
    if results:
        return f"It is {results[-1]} in Paris. STOP here"
    if "get_weather" in prompt:
        return "<think>The user wants the weather.</think>Let me check.\n" + CALL
    return "<think>A greeting.</think>Hello there! STOP here"


@pytest.fixture(scope="module")
def server(free_tcp_port):
    engine = ScriptedEngineClient(scripted_reply)
    config = ServerConfig(served_model_names=["scripted"], tool_parser="qwen", reasoning_parser="qwen3", api_keys=[KEY])
    with ThreadedServer(create_app(engine, config, start_engine=False), free_tcp_port()) as running:
        running.engine = engine
        yield running


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


def ask(client, **kwargs):
    return client.messages.create(
        model="scripted",
        max_tokens=kwargs.pop("max_tokens", 200),
        messages=kwargs.pop("messages", [{"role": "user", "content": "hi"}]),
        **kwargs,
    )


def test_plain_message_has_thinking_and_text_blocks(client, server):
    message = ask(client, system="Be brief.")
    assert server.engine.prompts[-1] == "<|system|>Be brief.<|user|>hi<|assistant|>"
    thinking, text = message.content
    assert (thinking.type, thinking.thinking) == ("thinking", "A greeting.")
    assert (text.type, text.text) == ("text", "Hello there! STOP here")
    assert message.stop_reason == "end_turn" and message.role == "assistant"
    assert message.usage.input_tokens == server.engine.prompt_lengths[-1]


def test_stop_sequences_end_the_reply_and_are_reported(client):
    message = ask(client, stop_sequences=[" STOP"])
    assert message.content[-1].text == "Hello there!"
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", " STOP")


def test_tool_use_round_trip(client, server):
    question = {"role": "user", "content": "Weather in Paris?"}
    first = ask(client, messages=[question], tools=TOOLS)
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    second = ask(
        client,
        tools=TOOLS,
        messages=[
            question,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
        ],
    )
    assert second.content[-1].text == "It is sunny in Paris. STOP here"
    prompt = server.engine.prompts[-1]
    assert '"name": "get_weather"' in prompt and prompt.endswith("<|tool|>sunny<|assistant|>")
    # the thinking block went back as the assistant turn's reasoning, not as text
    assert "The user wants the weather." not in prompt.split("<|assistant|>")[1].split('"name"')[0]


def test_stream_events_build_the_same_message(client):
    whole = ask(client, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
    with client.messages.stream(
        model="scripted", max_tokens=200, tools=TOOLS, messages=[{"role": "user", "content": "Weather in Paris?"}]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in final.content] == [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Paris"} and final.content[1].text == whole.content[1].text
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == whole.usage.output_tokens


def test_count_tokens_counts_the_rendered_prompt(client, server):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    counted = client.messages.count_tokens(model="scripted", messages=messages, tools=TOOLS, system="Be brief.")
    ask(client, messages=messages, tools=TOOLS, system="Be brief.")
    assert counted.input_tokens == server.engine.prompt_lengths[-1]


def test_errors_use_the_anthropic_envelope_and_x_api_key_is_checked(server, client):
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as error:
        ask(wrong)
    assert error.value.body["error"]["type"] == "authentication_error"
    response = httpx.post(
        server.base_url + "/v1/messages",
        headers={"x-api-key": KEY},
        json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 400
    assert response.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "missing required parameter 'max_tokens'"},
    }
    with pytest.raises(anthropic.BadRequestError) as error:
        ask(client, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert "'image'" in error.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
