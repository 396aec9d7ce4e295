"""The incremental driver shared by tool parsers whose calls sit in marked blocks.

A reply is content with tool-call *blocks* in it. A block opens at a marker (``<tool_call>``,
``[TOOL_CALLS]``, ...) anywhere in the text, or at an opener that counts only as the reply's
first non-space text (``{`` for bare JSON). A subclass reads one block with :meth:`scan_block`;
the driver keeps the text, emits content outside blocks (holding back what could be the start of
a marker), and turns the calls a block shows so far into OpenAI deltas.

Decisions are made at fixed positions of the text, never by chunk boundaries, so any chunking
gives the one-shot result:

* a call counts once its name is complete (and is one of the offered tools); from then on it
  stands, and its arguments text only grows;
* a block that ends (or is malformed, or the reply ends) without one call is plain content: its
  marker is shown and the text after it is read again as content;
* whitespace right before and after a call, and at the very end of the content of a reply
  with tool calls, is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.parsers.base import (
    ToolCallDelta,
    ToolParseDelta,
    ToolParser,
    new_tool_call_id,
    partial_marker_suffix,
)
from framework.parsers.json_scan import Malformed, scan_call, skip_ws


@dataclass(slots=True)
class RawCall:
    """A call as far as a block shows it: ``arguments`` is prefix-monotonic while arriving."""

    name: str
    arguments: str


@dataclass(slots=True)
class BlockScan:
    """One block read so far: its calls, and where reading resumes (None: the block goes on)."""

    calls: list[RawCall]
    end: int | None


@dataclass(slots=True)
class _Emitted:
    id: str
    name: str
    arguments: str


class MarkerToolParser(ToolParser):
    """Base of block-structured tool parsers; subclasses set the markers and :meth:`scan_block`."""

    #: Texts that open a block anywhere in the reply.
    markers: tuple[str, ...] = ()
    #: Single characters that open a block when they are the reply's first non-space text.
    start_openers: tuple[str, ...] = ()

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.text = ""  # the undecided tail of the reply (see _drop_decided); positions index it
        self.pos = 0  # text before pos is decided
        self.block: tuple[int, str] | None = None  # (where it opened, the marker)
        self.block_base = 0  # index of the block's first call in self.emitted
        self.emitted: list[_Emitted] = []
        self.pending_ws = ""
        self.seen_text = False  # non-space content or a block came before (start openers are off)
        self.after_call = False  # whitespace right after a call is dropped
        #: resumable scanning state of long arguments (see json_scan.container_end): keys are
        #: positions in ``text`` and values tuples whose first item is a position; the driver
        #: shifts both when it drops the decided text
        self.scan_cache: dict = {}

    def scan_block(self, text: str, start: int, marker: str, final: bool) -> BlockScan:
        """Read the block opened by ``marker`` at ``text[start]``; ``final``: no more text comes.

        ``text`` is the undecided tail of the reply, not all of it: between feeds the driver drops
        the decided text before ``pos``, so positions move. Keep nothing position-based across
        calls except in ``scan_cache`` (which the driver shifts).
        """
        raise NotImplementedError

    # --- the driver -----------------------------------------------------------------------
    def feed(self, text: str) -> ToolParseDelta:
        self._drop_decided()
        self.text += text
        return self._advance(final=False)

    def _drop_decided(self) -> None:
        """Keep only the undecided tail of the text (from ``pos``; an open block starts there):
        holding the whole reply would copy it, and rescan it, every token. Positions shift with it."""
        cut = self.pos
        if not cut:
            return
        self.text, self.pos = self.text[cut:], 0
        if self.block is not None:
            self.block = (self.block[0] - cut, self.block[1])
        self.scan_cache = {
            start - cut: (pos - cut, *rest) for start, (pos, *rest) in self.scan_cache.items() if start >= cut
        }

    def finish(self) -> ToolParseDelta:
        out = self._advance(final=True)
        if not self.emitted:
            out.content += self.pending_ws
        self.pending_ws = ""
        return out

    def _advance(self, final: bool) -> ToolParseDelta:
        out = ToolParseDelta()
        text = self.text
        while True:
            if self.block is None:
                found = self._find_opener()
                if found is None:
                    hold = 0 if final else partial_marker_suffix(text[self.pos :], self.markers)
                    self._content(out, text[self.pos : len(text) - hold])
                    self.pos = len(text) - hold
                    return out
                start, marker = found
                self._content(out, text[self.pos : start])
                self.pos, self.block, self.block_base = start, (start, marker), len(self.emitted)
                self.seen_text = True
            start, marker = self.block
            scan = self.scan_block(text, start, marker, final)
            calls = [call for call in scan.calls if self.is_known_tool(call.name)]
            self._sync_calls(out, calls)
            end = scan.end if scan.end is not None or not final else len(text)
            if end is None:
                return out
            self.block = None
            if calls:
                self.pos, self.pending_ws = end, ""  # whitespace between content and a call is dropped
                self.after_call = True
            else:  # not a tool call after all: the marker is text
                after_marker = start + max(len(marker), 1)
                self._content(out, text[start:after_marker])
                self.pos = after_marker

    def _find_opener(self) -> tuple[int, str] | None:
        text, best = self.text, None
        if not self.seen_text:
            first = skip_ws(text, self.pos)
            if first < len(text) and text[first] in self.start_openers:
                best = (first, text[first])
        for marker in self.markers:
            at = text.find(marker, self.pos)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, marker)
        return best

    def _content(self, out: ToolParseDelta, piece: str) -> None:
        """Content, with any whitespace at its end held until more content follows it."""
        if self.after_call:
            piece = piece.lstrip()
            self.after_call = not piece
        if not piece:
            return
        piece = self.pending_ws + piece
        kept = len(piece.rstrip())
        if kept:
            self.seen_text = True
        out.content += piece[:kept]
        self.pending_ws = piece[kept:]

    def _sync_calls(self, out: ToolParseDelta, calls: list[RawCall]) -> None:
        for k, call in enumerate(calls):
            index = self.block_base + k
            if index == len(self.emitted):
                self.emitted.append(_Emitted(new_tool_call_id(), call.name, call.arguments))
                out.tool_calls.append(ToolCallDelta(index, self.emitted[index].id, call.name, call.arguments))
                continue
            sent = self.emitted[index].arguments
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                out.tool_calls.append(ToolCallDelta(index, arguments=call.arguments[len(sent) :]))
                self.emitted[index].arguments = call.arguments


def read_json_calls(
    text: str,
    i: int,
    *,
    args_keys: tuple[str, ...] = ("arguments", "parameters"),
    separator: str | None = None,
    cache: dict | None = None,
) -> tuple[list[RawCall], int | None, bool]:
    """Read a call object, an array of them, or objects joined by ``separator``, from ``text[i]``.

    Returns ``(calls, end, is_malformed)``: ``end`` is past the last value (or the malformed
    position), None while the text goes on inside it. ``cache``: the parser's ``scan_cache``.
    """
    calls: list[RawCall] = []
    in_array = i < len(text) and text[i] == "["
    j = skip_ws(text, i + 1) if in_array else i
    if in_array and j < len(text) and text[j] == "]":
        return calls, j + 1, False
    while True:
        if j >= len(text):
            return calls, None, False
        scan = scan_call(text, j, args_keys=args_keys, cache=cache)
        if scan.name is not None:
            calls.append(RawCall(scan.name, scan.arguments(text)))
        if scan.malformed_at is not None:
            return calls, scan.malformed_at, True
        if scan.end is None:
            return calls, None, False
        j = skip_ws(text, scan.end)
        if j >= len(text):
            return calls, (None if in_array or separator else scan.end), False
        if in_array:
            if text[j] == "]":
                return calls, j + 1, False
            if text[j] != ",":
                return calls, j, True
        elif separator is not None and text.startswith(separator, j):
            pass
        else:
            return calls, scan.end, False
        j = skip_ws(text, j + 1)


def expect_marker(text: str, i: int, marker: str) -> int | None:
    """Past ``marker`` at ``text[i]``; None while the text ends inside it; raises Malformed otherwise."""
    if text.startswith(marker, i):
        return i + len(marker)
    if marker.startswith(text[i:]):
        return None
    raise Malformed(i)
