"""Grammars for ``tool_choice``: ``"required"`` and named functions, and ``"auto"`` in the generic format.

For ``required`` and named functions, as in vLLM, the reply is constrained to a JSON array of calls,
``[{"name": <one of the tools>, "parameters": <that tool's schema>}, ...]`` (at least one; exactly
the named function for a named choice), and read back with :class:`ConstrainedCallsParser`
whatever the model's own tool-call format is. ``auto`` is constrained only on the generic path
(:func:`auto_tool_calls_tag`); a model with a native format answers it freely.
"""

from __future__ import annotations

import json
from typing import Any

from framework.parsers.blocks import BlockScan, MarkerToolParser, read_json_calls
from framework.parsers.generic import CLOSE, OPEN


def _parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object", "properties": {}}


def tool_calls_schema(tools: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """The JSON schema of the reply: an array of ``{"name", "parameters"}`` objects, minItems 1.

    ``name`` restricts it to that one function (a named ``tool_choice``); otherwise each item
    is one of the tools (``anyOf``), its ``parameters`` held to that tool's schema.
    """
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not functions:
        raise ValueError(f"no tool named {name!r} among the request's tools")
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": _parameters_schema(f)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if name is not None:
        schema["maxItems"] = 1
    return schema


class ConstrainedCallsParser(MarkerToolParser):
    """Reads the constrained reply: a JSON array of ``{"name", "parameters"}`` calls."""

    start_openers = ("[",)

    def scan_block(self, text: str, start: int, marker: str, final: bool) -> BlockScan:
        calls, end, _ = read_json_calls(text, start, args_keys=("parameters", "arguments"), cache=self.scan_cache)
        return BlockScan(calls, end)


def auto_tool_calls_tag(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The xgrammar structural tag of a ``tool_choice: "auto"`` reply in the generic format
    (:mod:`framework.parsers.generic`): free text, in which each ``<tool_call>`` block is a call of
    one of ``tools``, ``{"name": <its name>, "arguments": <valid under its schema>}``, then
    ``</tool_call>``. Without ``parallel`` the reply ends after its first call."""
    tags = [
        {
            "type": "tag",
            "begin": f'{OPEN}{{"name": {json.dumps(t["function"]["name"], ensure_ascii=False)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": _parameters_schema(t["function"])},
            "end": f"}}{CLOSE}",
        }
        for t in tools
    ]
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [OPEN],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel,
        },
    }
