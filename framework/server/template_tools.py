"""What a chat template does with tools, found by rendering it, and the conversation fw writes
for a template that cannot show them itself.

:func:`probe_template` renders small conversations that hold a marker string (a tool named
``fw_probe_tool``, a call named ``fw_probe_call``, its result) and looks for the marker in the prompt: a template
that silently drops ``tools`` (SmolLM2's renders 34 tokens with or without them) is found at
start-up, not by a model that never saw its tools. :func:`with_generic_tools` then writes what
the template would have dropped in the generic format (:mod:`framework.parsers.generic`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.parsers.generic import tool_calls_text, tool_result_text, tool_system_prompt

PROBE = "fw_probe_tool"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": PROBE,
            "description": "a probe of the chat template",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
_USER = {"role": "user", "content": "What does the probe say?"}
_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "fwprobe01",
            "type": "function",
            "function": {"name": "fw_probe_call", "arguments": {"fw_probe_arg": "fw_probe_value"}},
        }
    ],
}
_RESULT = {"role": "tool", "tool_call_id": "fwprobe01", "name": PROBE, "content": "fw_probe_result"}


@dataclass(frozen=True, slots=True)
class TemplateToolSupport:
    """Which parts of a tool conversation the template renders (each checked by a marker)."""

    renders_tools: bool = False
    renders_tool_calls: bool = False
    renders_tool_results: bool = False
    #: False for a template that refuses (or drops) a system turn: the tool list opens the first user turn
    renders_system: bool = True

    @property
    def is_complete(self) -> bool:
        return self.renders_tools and self.renders_tool_calls and self.renders_tool_results

    def describe(self) -> str:
        parts = [
            ("tools", self.renders_tools),
            ("assistant tool_calls", self.renders_tool_calls),
            ("tool results", self.renders_tool_results),
        ]
        shown = [name for name, ok in parts if ok]
        dropped = [name for name, ok in parts if not ok]
        if not dropped:
            return "the chat template renders tools, tool calls and tool results"
        return (
            f"the chat template drops {', '.join(dropped)}"
            + (f" (renders {', '.join(shown)})" if shown else "")
            + "; fw writes them into the conversation itself"
        )


def probe_template(render: Any) -> TemplateToolSupport:
    """Render probe conversations with ``render(messages, tools)`` (the model's chat template) and
    report which parts show; a template that raises on a part does not render it."""

    def shows(marker: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
        try:
            return marker in render(messages, tools)
        except Exception:  # jinja errors of the model's own template (raise_exception on a role, ...)
            return False

    return TemplateToolSupport(
        renders_tools=shows(PROBE, [_USER], _PROBE_TOOLS),
        renders_tool_calls=shows("fw_probe_call", [_USER, _CALL], _PROBE_TOOLS),
        renders_tool_results=shows("fw_probe_result", [_USER, _CALL, _RESULT], _PROBE_TOOLS),
        renders_system=shows("fw_probe_system", [{"role": "system", "content": "fw_probe_system"}, _USER], None),
    )


def with_generic_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, support: TemplateToolSupport
) -> list[dict[str, Any]]:
    """``messages`` with what the template drops written in the generic format: the tool list at
    the end of the system turn (a new one first when there is none; the start of the first user
    turn where the template has no system turn), assistant ``tool_calls`` as blocks after the
    turn's text, and tool results as user turns."""
    result = []
    for message in messages:
        if message.get("tool_calls") and not support.renders_tool_calls:
            calls = message["tool_calls"]
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = tool_calls_text(message.get("content") or "", calls)
        elif message["role"] == "tool" and not support.renders_tool_results:
            message = {"role": "user", "content": tool_result_text(message.get("content") or "", message.get("name"))}
        result.append(message)
    if tools and not support.renders_tools:
        prompt = tool_system_prompt(tools)
        if result and result[0]["role"] in ("system", "developer"):
            first = result[0]
            result[0] = {**first, "content": f"{first['content']}\n\n{prompt}" if first.get("content") else prompt}
        elif support.renders_system:
            result.insert(0, {"role": "system", "content": prompt})
        else:  # no system turn to write into: the tool list opens the first user turn
            at = next((i for i, m in enumerate(result) if m["role"] == "user"), 0)
            if result:
                result[at] = {**result[at], "content": f"{prompt}\n\n{result[at].get('content') or ''}"}
    return result
