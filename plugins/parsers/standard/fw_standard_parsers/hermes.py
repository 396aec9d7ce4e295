"""Qwen 2.5 / Qwen 3 / Hermes: ``<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>``.

Several blocks may follow each other (parallel calls); a block may also hold a JSON array of
calls. Content before, between and after blocks is plain content.
"""

from __future__ import annotations

from framework.parsers.blocks import BlockScan, MarkerToolParser, expect_marker, read_json_calls
from framework.parsers.json_scan import Malformed, skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(MarkerToolParser):
    markers = (OPEN,)

    def scan_block(self, text: str, start: int, marker: str, final: bool) -> BlockScan:
        i = skip_ws(text, start + len(OPEN))
        if i >= len(text):
            return BlockScan([], None)
        if text[i] not in "{[":
            return BlockScan([], i)
        calls, end, is_malformed = read_json_calls(
            text, i, args_keys=("arguments", "parameters"), cache=self.scan_cache
        )
        if end is None or is_malformed:
            return BlockScan(calls, end)
        j = skip_ws(text, end)
        try:
            close_end = expect_marker(text, j, CLOSE)
        except Malformed as error:
            return BlockScan(calls, error.pos)
        return BlockScan(calls, close_end)
