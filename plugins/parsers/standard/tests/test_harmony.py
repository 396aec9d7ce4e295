"""The harmony parsers (gpt-oss): goldens of replies as gpt-oss writes them, streamed in any chunking
equal to one-shot, through the server's reasoning-then-tools chain and each parser alone."""

from __future__ import annotations

import pytest

from framework import registries
from framework.parsers.base import assemble
from framework.server.chat_tools import ChoiceParser
from framework.testing import check_tool_parser_streaming, random_chunks

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("get_weather", "get_time")
]

# replies as gpt-oss writes them after the prompt's "<|start|>assistant" (stop tokens may or may not be kept)
REASONING_THEN_FINAL = (
    "<|channel|>analysis<|message|>User asks 2+2. Simple: 4.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
)
REASONING_THEN_CALL = (
    '<|channel|>analysis<|message|>Need weather for Paris; call get_weather with {"city": "Paris"}.<|end|>'
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'
)
PREAMBLE_THEN_TWO_CALLS = (
    "<|channel|>analysis<|message|>Two lookups.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking both now.<|end|>"
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Köln"}<|call|>'
    "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|><|call|>"
)
TWO_ANALYSES_NO_STOP_TOKEN = (
    "<|channel|>analysis<|message|>First thought.<|end|><|start|>assistant<|channel|>analysis<|message|>Second."
    "<|end|><|start|>assistant<|channel|>final<|message|>Done"
)

# (reply, reasoning, content, [(name, arguments)]) through reasoning parser -> tool parser
CHAIN_GOLDENS = [
    (REASONING_THEN_FINAL, "User asks 2+2. Simple: 4.", "2 + 2 = 4.", []),
    (
        REASONING_THEN_CALL,
        'Need weather for Paris; call get_weather with {"city": "Paris"}.',
        None,
        [("get_weather", '{"city":"Paris"}')],
    ),
    (
        PREAMBLE_THEN_TWO_CALLS,
        "Two lookups.",
        "Checking both now.",
        [("get_weather", '{"city": "Köln"}'), ("get_time", "{}")],
    ),
    (TWO_ANALYSES_NO_STOP_TOKEN, "First thought.\nSecond.", "Done", []),
    ("Plain text from a model that ignores harmony.", "", "Plain text from a model that ignores harmony.", []),
]


def parsers():
    reasoning = registries.reasoning_parsers().get("harmony").load()
    tool = registries.tool_parsers().get("harmony").load()
    return reasoning, tool


def run_chain(text: str, pieces: list[str]):
    reasoning_cls, tool_cls = parsers()
    chain = ChoiceParser(reasoning_cls(), tool_cls(TOOLS))
    deltas = [chain.feed(piece) for piece in pieces] + [chain.finish()]
    reasoning = "".join(d.reasoning for d in deltas)
    from framework.parsers.base import ToolParseDelta

    calls = assemble([ToolParseDelta(d.content, d.tool_calls) for d in deltas])
    return reasoning, calls.content, [(c.name, c.arguments) for c in calls.tool_calls], deltas


@pytest.mark.parametrize("text,reasoning,content,calls", CHAIN_GOLDENS)
def test_the_chain_splits_reasoning_content_and_calls_alike_in_one_shot_and_any_chunking(
    text, reasoning, content, calls
):
    assert run_chain(text, [text])[:3] == (reasoning, content, calls)
    for seed in range(10):
        got = run_chain(text, random_chunks(text, seed, max_size=7))
        assert got[:3] == (reasoning, content, calls), seed
        streamed = "".join(d.content for d in got[3]) + "".join(d.reasoning for d in got[3])
        assert "<|" not in streamed  # no harmony markup ever reaches the client


def test_token_by_token_streaming_equals_one_shot():
    for text, *expected in CHAIN_GOLDENS:
        assert list(run_chain(text, ["", *text])[:3]) == expected  # an empty first delta decides nothing


@pytest.mark.parametrize("text", [g[0] for g in CHAIN_GOLDENS])
def test_the_tool_parser_alone_reads_raw_replies(text):
    """Without a reasoning parser (--reasoning-parser none) the analysis text is content, calls are calls."""
    _, tool_cls = parsers()
    result = check_tool_parser_streaming(tool_cls, text, TOOLS)
    expected_calls = next(g[3] for g in CHAIN_GOLDENS if g[0] == text)
    assert [(c.name, c.arguments) for c in result.tool_calls] == expected_calls
    assert "<|" not in (result.content or "")


def test_a_call_to_an_unknown_tool_is_not_a_call():
    _, tool_cls = parsers()
    text = '<|channel|>commentary to=functions.delete_all <|constrain|>json<|message|>{"x": 1}<|call|>'
    result = tool_cls(TOOLS).parse(text)
    assert result.tool_calls == [] and result.content == '{"x": 1}'


def test_arguments_stream_before_the_call_ends():
    reasoning_cls, tool_cls = parsers()
    *_, deltas = run_chain(REASONING_THEN_CALL, list(REASONING_THEN_CALL))
    fragments = [c.arguments for d in deltas for c in d.tool_calls if c.arguments]
    assert len(fragments) > 5 and "".join(fragments) == '{"city":"Paris"}'


def test_the_scanner_holds_only_an_undecided_tail():
    reasoning_cls, _ = parsers()
    parser = reasoning_cls()
    long_text = "<|channel|>analysis<|message|>" + "word < and <| more " * 500 + "<|end|>"
    held = 0
    for piece in random_chunks(long_text, 3):
        parser.feed(piece)
        held = max(held, len(parser.scanner.buffer))
    assert held <= 64


def test_both_parsers_ask_for_special_tokens_and_templates_with_channels_pick_them():
    reasoning_cls, tool_cls = parsers()
    assert reasoning_cls.needs_special_tokens and tool_cls.needs_special_tokens
    from framework import plugins

    template = "{{ '<|start|>assistant<|channel|>final<|message|>' }}Reasoning: {{ reasoning_effort }}"
    assert plugins.call_first("default_parsers", model_config=None, chat_template=template) == {
        "tool": "harmony",
        "reasoning": "harmony",
    }
