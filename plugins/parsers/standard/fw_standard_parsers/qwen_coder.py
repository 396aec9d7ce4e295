"""Qwen3-Coder's XML tool calls::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each is typed by the tool's JSON schema (``integer``, ``number``,
``boolean``, ``object``/``array`` read as JSON, otherwise a string). The arguments JSON is
streamed one parameter at a time: ``{"city": "Paris"`` then ``}`` when the function closes. A
``<function=...>`` without the ``<tool_call>`` wrapper is accepted too.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from framework.parsers.blocks import BlockScan, MarkerToolParser, RawCall, expect_marker
from framework.parsers.json_scan import Malformed, skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


class QwenCoderToolParser(MarkerToolParser):
    markers = (OPEN, FUNCTION)

    def scan_block(self, text: str, start: int, marker: str, final: bool) -> BlockScan:
        calls: list[RawCall] = []
        i = start + len(OPEN) if marker == OPEN else start
        try:
            while True:
                i = skip_ws(text, i)
                if i >= len(text):
                    return BlockScan(calls, None)
                if marker == OPEN and text.startswith(CLOSE, i):
                    return BlockScan(calls, i + len(CLOSE))
                if text.startswith(FUNCTION, i) or (FUNCTION.startswith(text[i:]) and not CLOSE.startswith(text[i:])):
                    i = self._scan_function(text, i, calls)
                    if i is None:
                        return BlockScan(calls, None)
                    if marker == FUNCTION:
                        return BlockScan(calls, i)
                elif marker == OPEN and CLOSE.startswith(text[i:]):
                    return BlockScan(calls, None)
                else:
                    raise Malformed(i)
        except Malformed as error:
            return BlockScan(calls, error.pos)

    def _scan_function(self, text: str, i: int, calls: list[RawCall]) -> int | None:
        """Read one ``<function=...>...</function>``, appending its call once its name is known."""
        name_start = expect_marker(text, i, FUNCTION)
        if name_start is None:
            return None
        name_end = text.find(">", name_start)
        if name_end < 0:
            if "\n" in text[name_start:]:
                raise Malformed(name_start)
            return None
        call = RawCall(text[name_start:name_end].strip(), "{")
        if not call.name:
            raise Malformed(name_start)
        calls.append(call)
        parts: list[str] = []
        j = name_end + 1
        while True:
            j = skip_ws(text, j)
            if j >= len(text):
                return None
            if text.startswith(FUNCTION_END, j):
                call.arguments = "{" + ", ".join(parts) + "}"
                return j + len(FUNCTION_END)
            if not text.startswith(PARAMETER, j):
                if PARAMETER.startswith(text[j:]) or FUNCTION_END.startswith(text[j:]):
                    return None
                raise Malformed(j)
            key_end = text.find(">", j + len(PARAMETER))
            if key_end < 0:
                return None
            value_end = text.find(PARAMETER_END, key_end + 1)
            if value_end < 0:
                return None
            key = text[j + len(PARAMETER) : key_end].strip()
            value = self._typed(call.name, key, _strip_one_newline(text[key_end + 1 : value_end]))
            parts.append(json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False))
            call.arguments = "{" + ", ".join(parts)
            j = value_end + len(PARAMETER_END)

    def _typed(self, function: str, key: str, value: str) -> Any:
        """The parameter's value typed by the tool's schema (a string where the schema says so or is silent)."""
        schema = (self.tools.get(function, {}).get("parameters") or {}).get("properties", {}).get(key, {})
        kind = schema.get("type") if isinstance(schema, dict) else None
        kinds = kind if isinstance(kind, list) else [kind]
        if value.strip().lower() == "null" and "string" not in kinds:
            return None
        for kind in kinds:
            try:
                if kind == "integer":
                    return int(value.strip())
                if kind == "number":
                    number = float(value.strip())
                    return (
                        int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
                    )
                if kind == "boolean" and value.strip().lower() in ("true", "false"):
                    return value.strip().lower() == "true"
                if kind in ("object", "array"):
                    try:
                        return json.loads(value)
                    except ValueError:
                        return ast.literal_eval(value.strip())
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                continue
        return value


def _strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value
