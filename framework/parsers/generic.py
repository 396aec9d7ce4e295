"""Generic tool calling: the format fw teaches a model whose chat template has none of its own.

When a model's template ignores ``tools`` (SmolLM2, Gemma 3, ...), fw writes the tool list into
the system turn itself (:func:`tool_system_prompt`) and asks for calls in one format, the one
Hermes and Qwen models were trained on::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

one block per call, plain text anywhere else. :class:`GenericToolParser` reads it back; for
``tool_choice: "auto"`` the reply is also constrained by
:func:`framework.parsers.tool_choice.auto_tool_calls_tag`: text is free, but a ``<tool_call>``
block must hold a call of one of the tools with arguments valid under its schema.

Earlier turns are written the same way when the template cannot show them: an assistant turn's
``tool_calls`` as blocks after its text (:func:`tool_calls_text`), and a tool result, where the
template drops the ``tool`` role, as a user turn (:func:`tool_result_text`).
"""

from __future__ import annotations

import json
from typing import Any

from framework.parsers.blocks import BlockScan, MarkerToolParser, expect_marker, read_json_calls
from framework.parsers.json_scan import Malformed, skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"

TOOLS_INTRO = "You can call these tools (functions). Each is described by one JSON object per line:"
CALL_INSTRUCTIONS = (
    "To call a tool, reply with one block per call, exactly in this form:\n"
    f'{OPEN}{{"name": "<tool name>", "arguments": <the arguments, a JSON object>}}{CLOSE}\n'
    f"Each result comes back in a later message inside {RESULT_OPEN}...{RESULT_CLOSE}. "
    "When no tool is needed, answer in plain text."
)


class GenericToolParser(MarkerToolParser):
    """Calls in ``<tool_call>...</tool_call>`` blocks: a JSON ``{"name", "arguments"}`` object (or
    an array of them; ``parameters`` is read as ``arguments``). Text outside blocks is content."""

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


def _definition(tool: dict[str, Any]) -> str:
    function = tool["function"]
    shown = {"name": function["name"]}
    if function.get("description"):
        shown["description"] = function["description"]
    shown["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
    return json.dumps(shown, ensure_ascii=False)


def tool_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The text fw adds to the system turn: every tool's name, description and parameter schema,
    then how to call one (the module's format)."""
    return "\n".join([TOOLS_INTRO, *(_definition(t) for t in tools), "", CALL_INSTRUCTIONS])


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it: compact JSON, arguments as an object where they parse."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return f"{OPEN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{CLOSE}"


def tool_calls_text(content: str, tool_calls: list[dict[str, Any]]) -> str:
    """An assistant turn's text with its OpenAI ``tool_calls`` written as blocks after it."""
    blocks = "".join(
        call_text(c["function"]["name"], c["function"].get("arguments", {}))
        for c in tool_calls
        if isinstance(c.get("function"), dict)
    )
    return f"{content}\n{blocks}" if content else blocks


def tool_result_text(content: str, name: str | None = None) -> str:
    """A tool message's content for a template that has no ``tool`` role (sent as a user turn)."""
    head = f'{{"name": {json.dumps(name, ensure_ascii=False)}}}\n' if name else ""
    return f"{RESULT_OPEN}\n{head}{content}\n{RESULT_CLOSE}"
