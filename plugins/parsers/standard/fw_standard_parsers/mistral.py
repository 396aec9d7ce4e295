"""Mistral tool calls after the ``[TOOL_CALLS]`` special token, in either generation of the format:

* v3 tokenizers: ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]``
* v11+ tokenizers: ``[TOOL_CALLS]f[ARGS]{...}`` (optionally ``f[CALL_ID]abc123xyz[ARGS]{...}``),
  one ``[TOOL_CALLS]`` per call.
"""

from __future__ import annotations

import re

from framework.parsers.blocks import BlockScan, MarkerToolParser, RawCall, expect_marker, read_json_calls
from framework.parsers.json_scan import Incomplete, Malformed, container_end, scan_value, skip_ws

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(MarkerToolParser):
    markers = (TOOL_CALLS,)
    needs_special_tokens = True

    def scan_block(self, text: str, start: int, marker: str, final: bool) -> BlockScan:
        i = skip_ws(text, start + len(TOOL_CALLS))
        if i >= len(text):
            return BlockScan([], None)
        if text[i] in "[{":
            calls, end, _ = read_json_calls(text, i, args_keys=("arguments", "parameters"), cache=self.scan_cache)
            return BlockScan(calls, end)
        match = _NAME.match(text, i)
        if match is None:
            return BlockScan([], i)
        j = match.end()
        if j == len(text):
            return BlockScan([], None)
        try:
            if text.startswith(CALL_ID, j) or CALL_ID.startswith(text[j:]):
                after = expect_marker(text, j, CALL_ID)
                if after is None:
                    return BlockScan([], None)
                args_at = text.find(ARGS, after)
                if args_at < 0:
                    return BlockScan([], None)
                j = args_at
            args_start = expect_marker(text, j, ARGS)
        except Malformed as error:
            return BlockScan([], error.pos)
        if args_start is None:
            return BlockScan([], None)
        call = RawCall(match.group(), "")
        args_start = skip_ws(text, args_start)
        try:
            is_container = args_start < len(text) and text[args_start] in "{["
            end = container_end(text, args_start, self.scan_cache) if is_container else scan_value(text, args_start)
        except Incomplete:
            if args_start < len(text) and text[args_start] in "{[":
                call.arguments = text[args_start:]
            return BlockScan([call], None)
        except Malformed as error:
            return BlockScan([call], error.pos)
        call.arguments = text[args_start:end]
        return BlockScan([call], end)
