"""gpt-oss's harmony format: ``analysis`` -> reasoning, ``commentary to=functions.NAME`` -> tool calls, the rest content.

A reply is a sequence of messages (the prompt ends with ``<|start|>assistant``, so the first
message's header follows at once)::

    <|channel|>analysis<|message|>Let me look that up.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

A header (up to ``<|message|>``) names the channel and, for a tool call, the recipient
(``to=functions.NAME``, before or after the channel); the body runs to ``<|end|>``, ``<|call|>``,
``<|return|>``, the next ``<|start|>`` or the end of the reply (the engine drops stop tokens).
Text outside any message is content. :class:`HarmonyScanner` cuts the text into these events
incrementally, holding back only what could be the start of a marker.

The reasoning parser runs first: analysis bodies become reasoning, final and preamble
(``commentary`` without recipient) bodies content, and each tool call is passed on to the tool
parser as one normalised message in the content. The tool parser turns messages with a recipient
into calls (``functions.`` dropped from the name; arguments are the body, ``{}`` when empty) and
every other body into content, so it also reads a raw reply when no reasoning parser runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from framework.parsers.base import (
    ReasoningParser,
    ToolCallDelta,
    ToolParseDelta,
    ToolParser,
    new_tool_call_id,
    partial_marker_suffix,
)

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
BODY_ENDS = (END, CALL, RETURN, START)
#: How a reply's first header may begin (the prompt already wrote ``<|start|>assistant``).
FIRST_HEADER_STARTS = (CHANNEL, " to=", "to=")
#: A header longer than this without ``<|message|>`` is not one: it is shown as content.
MAX_HEADER_CHARS = 512

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


@dataclass(frozen=True, slots=True)
class Header:
    """One message's channel (``analysis`` / ``commentary`` / ``final``, or None) and recipient."""

    channel: str | None
    recipient: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        channel, recipient = _CHANNEL.search(text), _RECIPIENT.search(text)
        return cls(channel and channel[1], recipient and recipient[1])

    def normalised(self) -> str:
        """The header written back as one tool-call message opening (for the tool parser)."""
        return f"{START}assistant to={self.recipient}{CHANNEL}{self.channel or 'commentary'}{MESSAGE}"


@dataclass(slots=True)
class Event:
    """``kind``: ``"plain"`` (text outside messages), ``"open"``, ``"body"`` or ``"close"`` of a message."""

    kind: str
    header: Header | None = None
    text: str = ""


class HarmonyScanner:
    """Incremental cutter of harmony text into :class:`Event` s (any chunking gives the same events' text)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "first"  # first -> header / between; header -> body -> between -> header ...
        self.header: Header | None = None
        self.pending_space = ""  # whitespace outside messages, shown only if plain text follows

    def feed(self, text: str, final: bool = False) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while self._step(events, final):
            pass
        return events

    def _step(self, events: list[Event], final: bool) -> bool:
        """Advance over the buffer once; False when it needs more text."""
        buf = self.buffer
        if self.state == "first":
            if not final and any(s.startswith(buf) for s in FIRST_HEADER_STARTS):
                return False  # empty, or could still become a header
            self.state = "header" if buf.startswith(FIRST_HEADER_STARTS) else "between"
            return bool(buf) or final
        if self.state == "header":
            at = buf.find(MESSAGE)
            if at < 0:
                if final or len(buf) > MAX_HEADER_CHARS:  # never a header: content after all
                    self._plain(events, buf)
                    self.buffer, self.state = "", "between"
                return False
            self.header = Header.parse(buf[:at])
            events.append(Event("open", self.header))
            self.buffer, self.state = buf[at + len(MESSAGE) :], "body"
            return True
        if self.state == "body":
            ends = [(buf.find(m), m) for m in BODY_ENDS if m in buf]
            if ends:
                at, marker = min(ends)
                if at:
                    events.append(Event("body", self.header, buf[:at]))
                events.append(Event("close", self.header, marker))
                self.buffer = buf[at + (0 if marker == START else len(marker)) :]
                self.state = "between"
                return True
            hold = 0 if final else partial_marker_suffix(buf, BODY_ENDS)
            if len(buf) > hold:
                events.append(Event("body", self.header, buf[: len(buf) - hold]))
            self.buffer = buf[len(buf) - hold :]
            if final and self.state == "body":
                events.append(Event("close", self.header, ""))
                self.state = "between"
            return False
        # between messages: plain text up to the next <|start|> or <|channel|>
        starts = [(buf.find(m), m) for m in (START, CHANNEL) if m in buf]
        if starts:
            at, marker = min(starts)
            self._plain(events, buf[:at])
            self.pending_space = ""
            self.buffer = buf[at + (len(START) if marker == START else 0) :]
            self.state = "header"
            return True
        hold = 0 if final else partial_marker_suffix(buf, (START, CHANNEL))
        self._plain(events, buf[: len(buf) - hold])
        self.buffer = buf[len(buf) - hold :]
        return False

    def _plain(self, events: list[Event], text: str) -> None:
        if not text:
            return
        if not text.strip():
            self.pending_space += text
            return
        events.append(Event("plain", None, self.pending_space + text))
        self.pending_space = ""


def _is_tool_call(header: Header | None) -> bool:
    return header is not None and header.recipient is not None


class HarmonyReasoningParser(ReasoningParser):
    """``analysis`` -> reasoning; tool calls passed on normalised; final and preambles -> content."""

    start_marker, end_marker = f"{CHANNEL}analysis{MESSAGE}", END
    needs_special_tokens = True

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        super().__init__(starts_in_reasoning)
        self.scanner = HarmonyScanner()
        self.has_reasoning = False

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self.scanner.feed(text))

    def finish(self) -> tuple[str, str]:
        return self._split(self.scanner.feed("", final=True))

    def _split(self, events: list[Event]) -> tuple[str, str]:
        reasoning, content = [], []
        for event in events:
            header = event.header
            if event.kind == "plain":
                content.append(event.text)
            elif _is_tool_call(header):
                content.append(
                    header.normalised() if event.kind == "open" else CALL if event.kind == "close" else event.text
                )
            elif header is not None and header.channel == "analysis":
                if event.kind == "open" and self.has_reasoning:
                    reasoning.append("\n")  # between analysis messages
                elif event.kind == "body":
                    reasoning.append(event.text)
                    self.has_reasoning = True
            elif event.kind == "body":
                content.append(event.text)
        return "".join(reasoning), "".join(content)


class HarmonyToolParser(ToolParser):
    """Messages with a recipient -> tool calls; other message bodies and plain text -> content."""

    needs_special_tokens = True

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        self.scanner = HarmonyScanner()
        self.num_calls = 0
        self.call_has_arguments = False
        self.in_call = False

    def feed(self, text: str) -> ToolParseDelta:
        return self._deltas(self.scanner.feed(text))

    def finish(self) -> ToolParseDelta:
        return self._deltas(self.scanner.feed("", final=True))

    def _deltas(self, events: list[Event]) -> ToolParseDelta:
        delta = ToolParseDelta()
        for event in events:
            header = event.header
            if event.kind == "open":
                name = (header.recipient or "").removeprefix("functions.")
                self.in_call = _is_tool_call(header) and bool(name) and self.is_known_tool(name)
                if self.in_call:
                    delta.tool_calls.append(ToolCallDelta(self.num_calls, new_tool_call_id(), name))
                    self.num_calls += 1
                    self.call_has_arguments = False
            elif event.kind == "body" and self.in_call:
                delta.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments=event.text))
                self.call_has_arguments = self.call_has_arguments or bool(event.text.strip())
            elif event.kind == "close" and self.in_call:
                if not self.call_has_arguments:
                    delta.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments="{}"))
                self.in_call = False
            elif event.kind in ("plain", "body"):
                delta.content += event.text
        return delta
