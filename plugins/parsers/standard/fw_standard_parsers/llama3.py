"""Llama 3.1+ JSON tool calls: ``{"name": "f", "parameters": {...}}``, optionally after
``<|python_tag|>``; several calls are joined by ``;``.

A reply read as calls starts with ``{`` (after spaces) or contains ``<|python_tag|>``, a special
token, so the server keeps special tokens in the text while this parser runs.
"""

from __future__ import annotations

from framework.parsers.blocks import BlockScan, MarkerToolParser, read_json_calls
from framework.parsers.json_scan import skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3ToolParser(MarkerToolParser):
    markers = (PYTHON_TAG,)
    start_openers = ("{",)
    needs_special_tokens = True

    def scan_block(self, text: str, start: int, marker: str, final: bool) -> BlockScan:
        i = skip_ws(text, start + len(PYTHON_TAG)) if marker == PYTHON_TAG else start
        if i >= len(text):
            return BlockScan([], None)
        if text[i] != "{":
            return BlockScan([], i)
        calls, end, _ = read_json_calls(
            text, i, args_keys=("parameters", "arguments"), separator=";", cache=self.scan_cache
        )
        return BlockScan(calls, end)
