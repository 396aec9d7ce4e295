"""Qwen 2.5 / Qwen 3 / Hermes: ``<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>``.

Several blocks may follow each other (parallel calls); a block may also hold a JSON array of
calls. Content before, between and after blocks is plain content. This is the format of fw's
generic tool calling (:mod:`framework.parsers.generic`), whose parser reads it.
"""

from __future__ import annotations

from framework.parsers.generic import GenericToolParser


class HermesToolParser(GenericToolParser):
    """The generic ``<tool_call>`` parser under the names Qwen and Hermes models are served by."""
