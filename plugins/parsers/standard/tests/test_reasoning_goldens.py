"""``<think>`` reasoning parsers: golden splits, any chunking equal to one-shot, the prompt-opened case."""

from __future__ import annotations

import random

import pytest

from framework import plugins, registries
from framework.testing import random_chunks

# (parser, starts_in_reasoning, reply, reasoning, content)
GOLDENS = [
    ("qwen3", False, "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "The user wants 2+2.", "It is 4."),
    ("qwen3", False, "No thinking here, <think> only mentioned.", None, "No thinking here, <think> only mentioned."),
    ("qwen3", True, "Still thinking</think>Done.", "Still thinking", "Done."),
    ("qwen3", False, "<think>\nnever closed", "never closed", ""),
    ("qwen3", False, "  <think>a < b</thi and more</think>  x </think> y", "a < b</thi and more", "x </think> y"),
    ("deepseek_r1", False, "Let me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    ("deepseek_r1", False, "<think>Hmm.</think>Paris.", "Hmm.", "Paris."),
    ("deepseek_r1", False, "no end tag at all", "no end tag at all", ""),
]


def make(name: str, starts: bool):
    return registries.reasoning_parsers().get(name).load()(starts_in_reasoning=starts)


@pytest.mark.parametrize("name,starts,text,reasoning,content", GOLDENS)
def test_one_shot_and_every_chunking_split_the_same(name, starts, text, reasoning, content):
    assert make(name, starts).parse(text) == (reasoning, content)
    for seed in range(8):
        parser = make(name, starts)
        pieces = [parser.feed(p) for p in random_chunks(text, seed, max_size=6)] + [parser.finish()]
        assert ("".join(r for r, _ in pieces) or None, "".join(c for _, c in pieces)) == (reasoning, content), seed


def test_end_marker_is_exposed_for_constrained_decoding():
    parser = make("qwen3", False)
    assert parser.end_marker == "</think>" and parser.start_marker == "<think>"


def test_a_prompt_that_opens_think_starts_the_reply_in_reasoning():
    cls = registries.reasoning_parsers().get("qwen3").load()
    assert cls.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not cls.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not cls.prompt_opens_reasoning("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "template,expected",
    [
        ("{% for m in messages %}<tool_call>{% endfor %}<think>", {"tool": "qwen", "reasoning": "qwen3"}),
        ("<｜Assistant｜><think>\n", {"tool": None, "reasoning": "deepseek_r1"}),
        ("[TOOL_CALLS]", {"tool": "mistral", "reasoning": None}),
        ("<|python_tag|>", {"tool": "llama3", "reasoning": None}),
        ("<function=x><tool_call>", {"tool": "qwen_coder", "reasoning": None}),
        ("{{ messages }}", {"tool": None, "reasoning": None}),
    ],
)
def test_default_parsers_are_picked_from_the_chat_template(template, expected):
    assert plugins.call_first("default_parsers", model_config=None, chat_template=template) == expected


@pytest.mark.parametrize("name,starts", [("qwen3", False), ("qwen3", True), ("deepseek_r1", False)])
def test_random_tag_soup_streams_like_one_shot(name, starts):
    rng = random.Random(99)
    fragments = ["<think>", "</think>", "<th", "</thi", "<", " ", "\n", "word", "x"]
    for _ in range(200):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 12)))
        expected = make(name, starts).parse(text)
        parser = make(name, starts)
        pieces = [parser.feed(p) for p in random_chunks(text, rng.randint(0, 99), max_size=6)] + [parser.finish()]
        assert ("".join(r for r, _ in pieces) or None, "".join(c for _, c in pieces)) == expected, text
