"""The Responses API (``/v1/responses``) driven by the official ``openai`` SDK against the real app,
its "model" scripted (scripted_engine.py) so that it reasons, calls a tool, and answers with the
tool's result once that is in its prompt: reasoning / message / function_call items, the typed
event stream, previous_response_id, GET / DELETE, store, background and cancel, and 400s.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from framework.server.app import create_app
from framework.server.state import ServerConfig

from .scripted_engine import ScriptedEngineClient, ThreadedServer

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def scripted_reply(prompt: str) -> str:
    """Reason and call get_weather until a tool result is in the prompt; then answer with it."""
    results = re.findall(r"<\|tool\|>(.*?)(?=<\||\n|$)", prompt)
    if "<|user|>slow" in prompt:
        return "word " * 400
    if results:
        return f"It is {results[-1]} in Paris."
    if "get_weather" in prompt:  # the tools are in the prompt
        return "<think>The user wants the weather.</think>Let me check.\n" + CALL
    return "<think>A greeting.</think>Hello there!"


class SlowScriptedEngine(ScriptedEngineClient):
    """Scripted, with a pause per output (so a background response is still running when cancelled)."""

    finished: set[str] = set()  # the requests whose whole reply was generated

    async def generate(self, request_id, prompt_token_ids, params, pooling=None):
        async for output in super().generate(request_id, prompt_token_ids, params, pooling):
            await asyncio.sleep(0.01)
            yield output
            if output.finish_reason is not None:
                self.finished.add(request_id)


@pytest.fixture(scope="module")
def server(free_tcp_port):
    engine = SlowScriptedEngine(scripted_reply)
    config = ServerConfig(served_model_names=["scripted"], tool_parser="qwen", reasoning_parser="qwen3")
    app = create_app(engine, config, start_engine=False)
    with ThreadedServer(app, free_tcp_port()) as running:
        running.engine, running.state = engine, app.state.server
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_plain_response_has_reasoning_and_message_items(client, server):
    response = client.responses.create(model="scripted", input="hi", instructions="Be brief.")
    assert server.engine.prompts[-1] == "<|system|>Be brief.<|user|>hi<|assistant|>"
    assert response.status == "completed" and response.output_text == "Hello there!"
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "A greeting."
    assert message.type == "message" and message.content[0].type == "output_text"
    assert response.usage.input_tokens == server.engine.prompt_lengths[-1]
    assert response.usage.output_tokens == len(
        server.engine.tokenizer.encode("<think>A greeting.</think>Hello there!", add_special_tokens=False)
    )


def test_function_call_and_follow_up_through_previous_response_id(client, server):
    first = client.responses.create(model="scripted", input="Weather in Paris?", tools=TOOLS, instructions="Use tools.")
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert first.output_text == "Let me check."
    second = client.responses.create(
        model="scripted",
        previous_response_id=first.id,
        tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
    )
    assert second.output_text == "It is sunny in Paris."
    assert second.previous_response_id == first.id
    prompt = server.engine.prompts[-1]
    # the stored conversation (without the first request's instructions), the call, and its result
    assert "<|system|>" not in prompt and "<|user|>Weather in Paris?" in prompt
    assert '"name": "get_weather"' in prompt and prompt.endswith("<|tool|>sunny<|assistant|>")


def test_input_items_become_the_conversation(client, server):
    client.responses.create(
        model="scripted",
        input=[
            {"role": "developer", "content": "Answer in French."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "rainy"},
        ],
        tools=TOOLS,
    )
    prompt = server.engine.prompts[-1]
    assert "<|developer|>Answer in French.<|user|>Weather?<|assistant|>" in prompt
    assert prompt.endswith("<|tool|>rainy<|assistant|>")


def test_stream_sends_the_typed_events_of_the_whole_response(client):
    whole = client.responses.create(model="scripted", input="Weather in Paris?", tools=TOOLS)
    events = list(client.responses.create(model="scripted", input="Weather in Paris?", tools=TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert (text, reasoning) == (whole.output_text, whole.output[0].content[0].text)
    assert json.loads(arguments) == {"city": "Paris"}
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert added == done == ["reasoning", "message", "function_call"]
    final = events[-1].response
    assert [i.type for i in final.output] == [i.type for i in whole.output]
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    # a streamed response is stored too
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_input_items_of_a_stored_response_are_listed(client):
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "rainy"},
    ]
    response = client.responses.create(model="scripted", input=items, tools=TOOLS)
    listed = client.responses.input_items.list(response.id).data
    assert [i.type for i in listed] == ["function_call_output", "function_call", "message"]  # newest first
    assert listed[0].output == "rainy" and listed[1].call_id == "c1"
    assert [
        i.type for i in client.responses.input_items.list(client.responses.create(model="scripted", input="hi").id).data
    ] == ["message"]


def test_get_and_delete_by_id_and_store_false(client):
    response = client.responses.create(model="scripted", input="hi")
    assert client.responses.retrieve(response.id).output_text == "Hello there!"
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = client.responses.create(model="scripted", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model="scripted", input="hi", previous_response_id=unstored.id)
    assert error.value.body["param"] == "previous_response_id"


def test_background_response_completes_and_cancel_stops_it(client, server):
    queued = client.responses.create(model="scripted", input="hi", background=True)
    assert queued.status in ("queued", "in_progress")
    deadline = time.monotonic() + 30
    while (done := client.responses.retrieve(queued.id)).status != "completed":
        assert time.monotonic() < deadline, done.status
        time.sleep(0.05)
    assert done.output_text == "Hello there!"
    slow = client.responses.create(model="scripted", input="slow", background=True)
    time.sleep(0.2)
    cancelled = client.responses.cancel(slow.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(slow.id).status == "cancelled"
    assert server.state.num_admitted == 0  # its admission was released
    assert server.engine.prompts[-1].endswith("<|user|>slow<|assistant|>")
    assert len(server.engine.finished) == len(server.engine.prompts) - 1  # the slow one never finished
    # deleting a running background response stops it and forgets it
    deleted = client.responses.create(model="scripted", input="slow", background=True)
    time.sleep(0.2)
    client.responses.delete(deleted.id)
    time.sleep(0.2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(deleted.id)
    assert server.state.num_admitted == 0


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("tools", [{"type": "web_search"}], "tools[0].type"),
        ("include", ["file_search_call.results"], "include"),
        (
            "input",
            [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}],
            "input[0].content[0].type",
        ),
        ("input", [{"type": "item_reference", "id": "x"}], "input[0].type"),
        ("truncation", "auto", "truncation"),
        ("conversation", "conv_1", "conversation"),
    ],
)
def test_fields_fw_cannot_honour_are_400s_naming_them(server, field, value, param):
    body = {"model": "scripted", "input": "hi", field: value}
    response = httpx.post(server.base_url + "/v1/responses", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_sdk_stream_helper_accumulates_the_events_into_the_response(client):
    whole = client.responses.create(model="scripted", input="Weather in Paris?", tools=TOOLS)
    with client.responses.stream(model="scripted", input="Weather in Paris?", tools=TOOLS) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == whole.output_text
    [call] = [item for item in final.output if item.type == "function_call"]
    assert json.loads(call.arguments) == {"city": "Paris"}
