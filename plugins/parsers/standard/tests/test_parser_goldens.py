"""Golden transcripts for every parser: one-shot results, and streamed deltas under random chunkings
(and under a real tokenizer's token-by-token detokenization) assembling to the same result."""

from __future__ import annotations

import random

import pytest

from framework import registries
from framework.parsers.base import assemble
from framework.parsers.tool_choice import ConstrainedCallsParser
from framework.testing import random_chunks

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "tags": {"type": "array"},
                },
            },
        },
    }
    for name in ("get_weather", "get_time")
]

# (parser, reply text, expected content, expected [(name, arguments)])
GOLDENS = [
    (
        "qwen",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        "Let me check.",
        [("get_weather", '{"city": "Paris", "days": 3}')],
    ),
    (
        "qwen",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        None,
        [("get_weather", '{"city": "Köln"}'), ("get_time", "{}")],
    ),
    (
        "qwen",
        '<tool_call>{"arguments": "{\\"city\\": \\"Rome\\"}", "name": "get_weather"}</tool_call> done',
        "done",
        [("get_weather", '{"city": "Rome"}')],
    ),
    (
        "qwen",
        "Plain answer with no tools, a < sign and <tool_ in it.",
        "Plain answer with no tools, a < sign and <tool_ in it.",
        [],
    ),
    (
        "qwen_coder",
        "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
        '<parameter=tags>\n["a", "b"]\n</parameter>\n</function>\n</tool_call>',
        "Sure.",
        [("get_weather", '{"city": "New York", "days": 3, "metric": true, "tags": ["a", "b"]}')],
    ),
    (
        "qwen_coder",
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
        None,
        [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')],
    ),
    (
        "json",
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]',
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    ("json", '  {"name": "get_time", "arguments": {"tz": "UTC"}}', None, [("get_time", '{"tz": "UTC"}')]),
    ("json", 'The answer is {"name": "get_time"}', 'The answer is {"name": "get_time"}', []),
    (
        "mistral",
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]get_time[ARGS]{}',
        "Checking.",
        [("get_weather", '{"city": "Lyon"}'), ("get_time", "{}")],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Nice"}}, {"name": "get_time", "arguments": {}}]',
        None,
        [("get_weather", '{"city": "Nice"}'), ("get_time", "{}")],
    ),
    ("mistral", '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "CET"}', None, [("get_time", '{"tz": "CET"}')]),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Bonn"}}; {"name": "get_time", "parameters": {}}',
        None,
        [("get_weather", '{"city": "Bonn"}'), ("get_time", "{}")],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_time", "parameters": {"tz": "PST"}}',
        None,
        [("get_time", '{"tz": "PST"}')],
    ),
    ("llama3", "It is sunny; no call needed.", "It is sunny; no call needed.", []),
]

# Malformed output is plain content, never an exception.
MALFORMED = [
    ("qwen", "<tool_call>\nnot json at all\n</tool_call>"),
    ("qwen", '<tool_call>{"name": 42}</tool_call> tail'),
    ("qwen", '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>'),
    ("qwen", '<tool_call>{"nam'),
    ("qwen_coder", "<tool_call>\n<function=get_weather\nno closing bracket"),
    ("qwen_coder", "<tool_call>\nhello\n</tool_call>"),
    ("json", "{not json"),
    ("json", "[1, 2, 3]"),
    ("mistral", "[TOOL_CALLS] this is prose"),
    ("mistral", "[TOOL_CALLS]get_weather and more prose"),
    ("llama3", "<|python_tag|>print('hello')"),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Bo'),  # cut off: the call stands with partial args
]


def load(name: str):
    return registries.tool_parsers().get(name).load()


def stream(parser_cls, text: str, pieces: list[str]):
    parser = parser_cls(TOOLS)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return assemble(deltas), deltas


def summary(result) -> tuple:
    return result.content, [(c.name, c.arguments) for c in result.tool_calls]


@pytest.mark.parametrize("name,text,content,calls", GOLDENS)
def test_one_shot_result_matches_the_golden(name, text, content, calls):
    result = load(name)(TOOLS).parse(text)
    assert summary(result) == (content, calls)
    assert all(c.id.startswith("call_") for c in result.tool_calls)


@pytest.mark.parametrize("name,text,content,calls", GOLDENS)
def test_streamed_deltas_assemble_to_the_one_shot_result_for_any_chunking(name, text, content, calls):
    parser_cls = load(name)
    for seed in range(8):
        result, deltas = stream(parser_cls, text, random_chunks(text, seed))
        assert summary(result) == (content, calls), seed
        # OpenAI's streaming shape: a call's first delta has its id and name; later ones only arguments.
        seen = set()
        for delta in deltas:
            for piece in delta.tool_calls:
                assert (piece.name is not None) == (piece.index not in seen)
                seen.add(piece.index)


@pytest.mark.parametrize("name,text,content,calls", [g for g in GOLDENS if g[3]])
def test_tool_markup_never_reaches_streamed_content(name, text, content, calls):
    _, deltas = stream(load(name), text, list(text))
    streamed_content = "".join(d.content for d in deltas)
    for marker in ("<tool_call>", "</tool_call>", "<function=", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", '"name"'):
        assert marker not in streamed_content


def test_arguments_stream_as_fragments_before_the_call_ends():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    _, deltas = stream(load("qwen"), text, list(text))
    fragments = [piece.arguments for d in deltas for piece in d.tool_calls if piece.arguments]
    assert len(fragments) > 10 and "".join(fragments) == '{"city": "Paris", "days": 3}'


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_output_is_content_and_streams_the_same(name, text):
    parser_cls = load(name)
    one_shot = parser_cls(TOOLS).parse(text)
    if one_shot.tool_calls:  # only a call whose name was complete may stand, with the arguments written so far
        assert summary(one_shot) == (None, [("get_weather", '{"city": "Bo')])
    else:
        assert one_shot.content == text
    for seed in range(5):
        assert summary(stream(parser_cls, text, random_chunks(text, seed))[0]) == summary(one_shot)


def test_constrained_calls_parser_reads_the_tool_choice_array():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    expected = (None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])
    assert summary(ConstrainedCallsParser(TOOLS).parse(text)) == expected
    for seed in range(5):
        assert summary(stream(ConstrainedCallsParser, text, random_chunks(text, seed))[0]) == expected


def test_streaming_under_a_real_byte_level_tokenizer(byte_level_tokenizer):
    """Pieces as the server sees them: token by token through the incremental detokenizer."""
    for name, text, content, calls in GOLDENS:
        detokenizer = byte_level_tokenizer.detokenizer()
        pieces = [detokenizer.step(t) for t in byte_level_tokenizer.encode(text, add_special_tokens=False)]
        assert "".join(pieces) == text
        assert summary(stream(load(name), text, pieces)[0]) == (content, calls), name


@pytest.fixture(scope="module")
def byte_level_tokenizer():
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from framework.tokenizer import Tokenizer

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator([g[1] for g in GOLDENS] * 3, trainer)
    return Tokenizer(backend)


def test_the_conformance_helper_accepts_every_golden():
    from framework.testing import check_tool_parser_streaming

    for name, text, content, calls in GOLDENS:
        result = check_tool_parser_streaming(load(name), text, TOOLS)
        assert summary(result) == (content, calls)


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<function=get_weather>",
    "<parameter=city>",
    "</parameter>",
    "</function>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    '{"name": "get_weather", "arguments": ',
    '{"city": "Oslo"}',
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    ",",
    ";",
    " ",
    "\n",
    "get_time",
    "text",
    "<",
    "<tool",
    "[TOOL",
]


@pytest.mark.parametrize("name", ["qwen", "hermes", "qwen_coder", "json", "mistral", "llama3"])
def test_random_marker_soup_never_raises_and_streams_like_one_shot(name):
    """Deterministic fuzzing: replies built from markup fragments, valid or not."""
    parser_cls = load(name)
    rng = random.Random(1234)
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 14)))
        one_shot = parser_cls(TOOLS).parse(text)
        streamed, _ = stream(parser_cls, text, random_chunks(text, rng.randint(0, 99)))
        assert summary(streamed) == summary(one_shot), text
        if not one_shot.tool_calls:
            assert one_shot.content == text  # nothing read as a call: every character is content


def _long_prose(seed: int, words: int = 3000) -> str:
    rng = random.Random(seed)
    vocabulary = ["the", "weather", "is", "fine,", "a < b", "and", "[TOOL", "<tool", "text.", "\n", "<|python", "call"]
    return " ".join(rng.choice(vocabulary) for _ in range(words))


@pytest.mark.parametrize("name,text,content,calls", [g for g in GOLDENS if g[3]])
def test_a_long_reply_fed_token_by_token_matches_one_shot_and_holds_only_its_tail(name, text, content, calls):
    """Each feed keeps only the undecided tail: the text held never grows with the reply
    (appending to the whole reply made streaming quadratic), and the result is the one-shot one."""
    parser_cls = load(name)
    for reply in (text + " " + _long_prose(1), _long_prose(2) + text + _long_prose(3)):
        parser = parser_cls(TOOLS)
        deltas, held = [], 0
        for piece in random_chunks(reply, 7):
            deltas.append(parser.feed(piece))
            held = max(held, len(parser.text))
        deltas.append(parser.finish())
        assert summary(assemble(deltas)) == summary(parser_cls(TOOLS).parse(reply))
        assert held <= len(text) + 64, (held, len(reply))
