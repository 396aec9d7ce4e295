"""A reply that is a bare JSON call, ``{"name": "f", "arguments": {...}}``, or an array of them.

Only a reply whose first non-space character is ``{`` or ``[`` is read as calls; ``parameters``
is accepted for ``arguments``. Text after the JSON value is content.
"""

from __future__ import annotations

from framework.parsers.blocks import BlockScan, MarkerToolParser, read_json_calls


class JsonToolParser(MarkerToolParser):
    start_openers = ("{", "[")

    def scan_block(self, text: str, start: int, marker: str, final: bool) -> BlockScan:
        calls, end, _ = read_json_calls(text, start, args_keys=("arguments", "parameters"), cache=self.scan_cache)
        return BlockScan(calls, end)
