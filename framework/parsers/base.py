"""The contracts of per-request output parsers, and the values they produce.

Both kinds are incremental: ``feed(text)`` takes the next piece of generated text and returns what
it makes visible now; ``finish()`` flushes what was held back. Invariant (tested for every
parser with random chunkings): the deltas of any chunking assemble to the same result as one
``feed`` of the whole text followed by ``finish`` (:meth:`ToolParser.parse`). A parser never
raises on model output: text it cannot read as a tool call or a reasoning block is content.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any


def new_tool_call_id() -> str:
    """An OpenAI-shaped tool call id (``call_`` + 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class ToolCall:
    """One complete tool call: ``arguments`` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ToolCallDelta:
    """A streamed piece of tool call ``index``: its first delta carries ``id`` and ``name``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ToolParseDelta:
    """What one ``feed`` / ``finish`` made visible: plain content and tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass(slots=True)
class ToolParseResult:
    """A whole reply: content (``None`` when only whitespace beside tool calls) and the calls."""

    content: str | None
    tool_calls: list[ToolCall]


def assemble(deltas: list[ToolParseDelta]) -> ToolParseResult:
    """Join streamed deltas the way an OpenAI client does (by ``index``)."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            call = calls.get(piece.index)
            if call is None:
                call = calls[piece.index] = ToolCall(piece.id or "", piece.name or "", "")
            call.arguments += piece.arguments
    tool_calls = [calls[i] for i in sorted(calls)]
    return ToolParseResult(None if tool_calls and not content.strip() else content, tool_calls)


class ToolParser:
    """Reads tool calls out of a model's reply, incrementally.

    One instance per request (per choice). ``tools`` are the request's function definitions
    (OpenAI ``tools`` entries, ``{"type": "function", "function": {...}}``); a parser may use them
    to reject unknown names and to type arguments. Subclasses implement :meth:`feed` and
    :meth:`finish` under the module invariant; while streaming they emit a call's ``id`` and
    ``name`` in its first delta and its arguments as fragments, and never show tool markup as
    content.
    """

    #: Special tokens this format writes (``[TOOL_CALLS]``, ``<|python_tag|>``): the server keeps
    #: special tokens in the text while this parser runs.
    needs_special_tokens: bool = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = {t["function"]["name"]: t["function"] for t in tools or [] if _function_name(t)}

    def feed(self, text: str) -> ToolParseDelta:
        """Take the next generated text; return what it makes visible."""
        raise NotImplementedError

    def finish(self) -> ToolParseDelta:
        """The reply ended: flush held-back text (an unfinished call stands if its name was complete)."""
        raise NotImplementedError

    def parse(self, text: str) -> ToolParseResult:
        """One-shot: the whole reply at once."""
        return assemble([self.feed(text), self.finish()])

    def is_known_tool(self, name: str) -> bool:
        """Names outside the offered tools are not calls (when tools were offered at all)."""
        return not self.tools or name in self.tools


class ReasoningParser:
    """Splits a reply into reasoning and content, incrementally.

    One instance per request. ``starts_in_reasoning`` is True when the prompt already opened the
    reasoning block (the template ended with ``<think>``). ``feed`` / ``finish`` return
    ``(reasoning, content)`` pieces under the module invariant. ``end_marker`` is the text that
    ends reasoning (``</think>``): grammar-constrained output starts after it.
    """

    start_marker: str = ""
    end_marker: str = ""
    #: The format's markers are special tokens (harmony's ``<|channel|>``): the server keeps
    #: special tokens in the text while this parser runs.
    needs_special_tokens: bool = False

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.starts_in_reasoning = starts_in_reasoning

    @classmethod
    def prompt_opens_reasoning(cls, prompt: str) -> bool:
        """Whether a rendered prompt leaves the model inside a reasoning block."""
        if not cls.start_marker:
            return False
        start = prompt.rfind(cls.start_marker)
        return (
            start >= 0 and cls.end_marker not in prompt[start:] and not prompt[start + len(cls.start_marker) :].strip()
        )

    def feed(self, text: str) -> tuple[str, str]:
        """Take the next generated text; return ``(reasoning, content)`` made visible."""
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        """The reply ended: flush held-back text."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, str]:
        """One-shot: ``(reasoning or None, content)`` of a whole reply."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return (r1 + r2) or None, c1 + c2


def _function_name(tool: Any) -> str | None:
    function = tool.get("function") if isinstance(tool, dict) else None
    return function.get("name") if isinstance(function, dict) else None


def partial_marker_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that could be the start of one of ``markers``."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-size:]):
                best = size
                break
    return best
