"""Tools, tool_choice and reasoning through a real ``fw serve`` (tiny random-weight Llama), driven
by the ``openai`` client.

The tiny model writes only ``t<i>`` words, so it never calls a tool by itself: here the
plumbing is checked (tools reach the template, tool_choice none drops them, streams with tools
work, bad tools are 400s), and reasoning is checked by a template that opens ``<think>``, which
makes the whole reply reasoning: it must equal the plain completion of the same prompt.
"""

from __future__ import annotations

import httpx
import openai
import pytest

TEMPLATE = (
    "{% if tools %}{% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c['function']['name'] }} {% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant{% if enable_thinking %} <think>{% endif %}{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": "a tool",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
    for name in ("t7", "t8")
]
MESSAGES = [{"role": "user", "content": "t5 t9 t12 t40"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, write_tiny_llama):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tools"), TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir, serve_on_free_port):
    with serve_on_free_port(
        [
            "--m",
            str(model_dir),
            "--device",
            "cpu",
            "--served-model-name",
            "tiny",
            "--enforce-parser",
            "qwen",
            "--reasoning-parser",
            "qwen3",
        ]
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from framework.tokenizer import Tokenizer

    return Tokenizer.from_directory(model_dir)


def chat(client, **kwargs):
    return client.chat.completions.create(
        model="tiny",
        messages=kwargs.pop("messages", MESSAGES),
        temperature=0,
        max_tokens=kwargs.pop("max_tokens", 6),
        **kwargs,
    )


def test_tools_are_rendered_by_the_chat_template(client, tokenizer):
    with_tools = chat(client, tools=TOOLS)
    without = chat(client)
    assert with_tools.usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES, tools=TOOLS))
    assert with_tools.usage.prompt_tokens == without.usage.prompt_tokens + 2  # "t7 t8 "
    message = with_tools.choices[0].message
    assert message.tool_calls is None and message.content  # the model wrote words, not a call


def test_tool_choice_none_offers_no_tools(client, tokenizer):
    response = chat(client, tools=TOOLS, tool_choice="none")
    assert response.usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES))


def test_streamed_request_with_tools_equals_the_non_streamed_one(client):
    full = chat(client, tools=TOOLS, tool_choice="auto", extra_body={"ignore_eos": True})
    stream = chat(client, tools=TOOLS, tool_choice="auto", stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "length"


def test_assistant_tool_calls_and_tool_messages_are_accepted(client, tokenizer):
    messages = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "t7", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "t20"},
    ]
    response = chat(client, messages=messages, tools=TOOLS)
    rendered = tokenizer.apply_chat_template([{**m, "content": m["content"] or ""} for m in messages], tools=TOOLS)
    assert "assistant  t7 tool t20" in rendered
    assert response.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_reasoning_is_split_from_content_streamed_and_not(client, tokenizer):
    kwargs = {"chat_template_kwargs": {"enable_thinking": True}, "ignore_eos": True}
    prompt = tokenizer.apply_chat_template(MESSAGES, enable_thinking=True)
    assert prompt.endswith("<think>")
    reference = client.completions.create(
        model="tiny",
        prompt=tokenizer.encode(prompt, add_special_tokens=False),
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    response = chat(client, extra_body=kwargs)
    message = response.choices[0].message
    expected = reference.choices[0].text.strip()
    assert expected and message.reasoning_content == expected and message.model_extra["reasoning"] == expected
    assert not message.content
    chunks = list(chat(client, stream=True, extra_body=kwargs))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == expected
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_without_thinking_the_reply_is_content(client):
    response = chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert response.choices[0].message.content and response.choices[0].message.reasoning_content is None


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        ({"tools": "nope"}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"mcp_execute": True}, "mcp_execute"),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(server, body, param):
    response = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": MESSAGES, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert httpx.get(server.base_url + "/health").status_code == 200
