"""``<think>...</think>`` reasoning, as DeepSeek-R1 and Qwen3 write it.

The reply is ``[<think>] reasoning </think> content``. Reasoning starts when the reply opens
with ``<think>`` (after spaces), or at once when the prompt already opened it
(``starts_in_reasoning``; DeepSeek-R1 always assumes so). Whitespace around the reasoning and at
the start of the content after ``</think>`` is dropped; while streaming, text that could be the
start of a tag is held back until it is decided.
"""

from __future__ import annotations

from framework.parsers.base import ReasoningParser, partial_marker_suffix

THINK, END_THINK = "<think>", "</think>"


class Qwen3ReasoningParser(ReasoningParser):
    start_marker, end_marker = THINK, END_THINK

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        super().__init__(starts_in_reasoning)
        self.text = ""
        self.pos = 0
        self.state = "start"  # start -> reasoning -> content, or start -> content
        self.reasoning_ws = ""  # whitespace after reasoning text, shown only if more reasoning follows
        self.reasoning_started = False
        self.strip_content = False  # drop whitespace at the start of the content after </think>

    def feed(self, text: str) -> tuple[str, str]:
        # only the undecided tail is kept: appending to the whole reply would copy it every token
        self.text = self.text[self.pos :] + text
        self.pos = 0
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        text = self.text
        while True:
            if self.state == "start":
                rest = text[self.pos :]
                stripped = rest.lstrip()
                if stripped.startswith(THINK):
                    self.pos = len(text) - len(stripped) + len(THINK)
                    self.state = "reasoning"
                    continue
                if not final and THINK.startswith(stripped):
                    return reasoning, content
                self.state = "reasoning" if self.starts_in_reasoning else "content"
                continue
            if self.state == "reasoning":
                end = text.find(END_THINK, self.pos)
                if end >= 0:
                    reasoning += self._reasoning(text[self.pos : end])
                    self.pos, self.state, self.strip_content = end + len(END_THINK), "content", True
                    continue
                hold = 0 if final else partial_marker_suffix(text[self.pos :], (END_THINK,))
                reasoning += self._reasoning(text[self.pos : len(text) - hold])
                self.pos = len(text) - hold
                return reasoning, content
            piece = text[self.pos :]
            self.pos = len(text)
            if self.strip_content:
                piece = piece.lstrip()
                self.strip_content = not piece
            return reasoning, content + piece

    def _reasoning(self, piece: str) -> str:
        """Reasoning text without leading or trailing whitespace, whatever the chunking."""
        if not self.reasoning_started:
            piece = piece.lstrip()
            self.reasoning_started = bool(piece)
        if not piece:
            return ""
        piece = self.reasoning_ws + piece
        kept = len(piece.rstrip())
        self.reasoning_ws = piece[kept:]
        return piece[:kept]


class DeepSeekR1ReasoningParser(Qwen3ReasoningParser):
    """DeepSeek-R1: its template opens ``<think>``, so a reply is reasoning until ``</think>``."""

    def __init__(self, starts_in_reasoning: bool = True) -> None:
        super().__init__(starts_in_reasoning=True)
