"""``tool_choice: "required"`` and named functions, enforced by grammar-constrained decoding.

As in vLLM, the reply is constrained to a JSON array of calls,
``[{"name": <one of the tools>, "parameters": <that tool's schema>}, ...]`` (at least one; exactly
the named function for a named choice), and read back with :class:`ConstrainedCallsParser`
whatever the model's own tool-call format is.
"""

from __future__ import annotations

from typing import Any

from framework.parsers.blocks import BlockScan, MarkerToolParser, read_json_calls


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
