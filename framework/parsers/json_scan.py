"""Scanning JSON that may still be arriving: where a value ends, or that it has not ended yet.

``scan_value(text, i)`` returns the index just past the JSON value starting at ``text[i]``; it
raises :class:`Incomplete` when the text ends inside the value and :class:`Malformed` (with the
offending position) when the text cannot be JSON. :func:`scan_call` reads one tool-call object
(``{"name": ..., "arguments": ...}``) as far as it goes, for parsers that stream arguments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)
_OUTSIDE_STRINGS = re.compile(r'[^"{}\[\]]*')


class Incomplete(Exception):
    """The text ends inside the value."""


class Malformed(Exception):
    """The text is not JSON at ``pos``."""

    def __init__(self, pos: int) -> None:
        super().__init__(pos)
        self.pos = pos


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def next_char(text: str, i: int) -> int:
    """The index of the first non-whitespace character at or after ``i``; :class:`Incomplete` if
    the text ends first."""
    j = skip_ws(text, i)
    if j >= len(text):
        raise Incomplete
    return j


def scan_string(text: str, i: int) -> int:
    """``text[i]`` is ``"``; return the index past the closing quote (raw control chars allowed)."""
    j = _STRING_BODY.match(text, i + 1).end()  # a regex, not a Python loop: arguments can be long code
    if j < len(text) and text[j] == '"':
        return j + 1
    raise Incomplete


def scan_value(text: str, i: int) -> int:
    """The index past the value at ``text[i]`` (no leading whitespace)."""
    try:
        return _scan_value(text, i)
    except RecursionError:
        raise Malformed(i) from None


def _scan_value(text: str, i: int) -> int:
    if i >= len(text):
        raise Incomplete
    char = text[i]
    if char == "{":
        return _scan_container(text, i, "}", is_object=True)
    if char == "[":
        return _scan_container(text, i, "]", is_object=False)
    if char == '"':
        return scan_string(text, i)
    if char in "-0123456789":
        j = i
        while j < len(text) and text[j] in _NUMBER_CHARS:
            j += 1
        if j == len(text):
            raise Incomplete  # a number at the end of the text may go on
        try:
            json.loads(text[i:j])
        except ValueError:
            raise Malformed(i) from None
        return j
    for literal in _LITERALS:
        if text.startswith(literal, i):
            return i + len(literal)
        if literal.startswith(text[i:]):
            raise Incomplete
    raise Malformed(i)


def _scan_container(text: str, i: int, close: str, is_object: bool) -> int:
    j = next_char(text, i + 1)
    if text[j] == close:
        return j + 1
    while True:
        if is_object:
            if text[j] != '"':
                raise Malformed(j)
            j = next_char(text, scan_string(text, j))
            if text[j] != ":":
                raise Malformed(j)
            j = skip_ws(text, j + 1)
        j = next_char(text, _scan_value(text, j))
        if text[j] == close:
            return j + 1
        if text[j] != ",":
            raise Malformed(j)
        j = next_char(text, j + 1)


def container_end(text: str, start: int, cache: dict | None = None) -> int:
    """Past the object or array at ``text[start]``, found by bracket depth alone (strings skipped).

    Resumable: with a ``cache`` (one per growing text), a call scans only the characters added
    since the last call, so streaming a long arguments object costs linear, not quadratic, time.
    Raises Incomplete while the container is open.
    """
    pos, depth, in_string = (cache or {}).get(start, (start, 0, False))
    while pos < len(text):
        if in_string:
            pos = _STRING_BODY.match(text, pos).end()
            if pos >= len(text) or text[pos] != '"':  # the text ends inside the string (maybe mid-escape)
                break
            in_string, pos = False, pos + 1
            continue
        pos = _OUTSIDE_STRINGS.match(text, pos).end()
        if pos >= len(text):
            break
        char = text[pos]
        pos += 1
        if char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return pos
    if cache is not None:
        cache[start] = (pos, depth, in_string)
    raise Incomplete


@dataclass(slots=True)
class CallScan:
    """How far one tool-call object has been read.

    ``name`` is set once its string is complete; ``args_start``/``args_end`` delimit the
    arguments value (``args_end`` is None while it is still arriving); ``end`` is the index past
    the closing brace; ``malformed_at`` is where the text stopped being a call object.
    """

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None
    malformed_at: int | None = None

    def arguments(self, text: str) -> str:
        """The arguments JSON text so far; it only ever grows (prefix-monotonic) as text arrives."""
        if self.args_start is None:
            return "{}" if self.end is not None else ""
        opener = text[self.args_start]
        if self.args_end is None:  # still arriving: only an object or array is streamed raw
            return text[self.args_start :] if opener in "{[" else ""
        raw = text[self.args_start : self.args_end]
        if opener == '"':  # arguments given as a JSON-encoded string
            try:
                return json.loads(raw, strict=False)
            except ValueError:
                return raw
        return "{}" if raw == "null" else raw


def scan_call(
    text: str,
    i: int,
    name_keys: tuple[str, ...] = ("name",),
    args_keys: tuple[str, ...] = ("arguments", "parameters"),
    cache: dict | None = None,
) -> CallScan:
    """Read the call object starting at ``text[i]`` (``{``) as far as the text goes.

    An arguments object or array is delimited by :func:`container_end` (resumable with ``cache``).
    """
    scan = CallScan()
    try:
        if i >= len(text):
            raise Incomplete
        if text[i] != "{":
            raise Malformed(i)
        j = next_char(text, i + 1)
        if text[j] == "}":
            scan.end = j + 1
            return scan
        while True:
            if text[j] != '"':
                raise Malformed(j)
            key_end = scan_string(text, j)
            key = json.loads(text[j:key_end], strict=False)
            j = next_char(text, key_end)
            if text[j] != ":":
                raise Malformed(j)
            j = next_char(text, j + 1)
            if key in name_keys and scan.name is None:
                if text[j] != '"':
                    raise Malformed(j)
                value_end = scan_string(text, j)
                scan.name = json.loads(text[j:value_end], strict=False)
            elif key in args_keys and scan.args_start is None:
                scan.args_start = j
                is_container = text[j] in "{["
                value_end = scan.args_end = container_end(text, j, cache) if is_container else scan_value(text, j)
            else:
                value_end = scan_value(text, j)
            j = next_char(text, value_end)
            if text[j] == "}":
                scan.end = j + 1
                return scan
            if text[j] != ",":
                raise Malformed(j)
            j = next_char(text, j + 1)
    except Incomplete:
        pass
    except Malformed as error:
        scan.malformed_at = error.pos
    except (RecursionError, ValueError):  # nesting too deep, or a bad escape in a key or the name
        scan.malformed_at = i
    return scan
