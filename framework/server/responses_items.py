"""The output items of a ``/v1/responses`` response, made from a chat reply, and back into messages."""

from __future__ import annotations

from typing import Any

from framework.server.mcp_client import SEPARATOR
from framework.server.protocol import ChatMessage, MCPCallRecord, ResponseMessage, Usage
from framework.server.responses_input import input_messages
from framework.server.state import new_id


def new_item_id(prefix: str) -> str:
    return new_id(prefix).replace("-", "_")


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": new_item_id("msg"),
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else [],
    }


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": new_item_id("rs"),
        "summary": [],
        "status": status,
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": new_item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def mcp_item(record: MCPCallRecord) -> dict[str, Any]:
    """A call the server ran (``mcp_execute``), as OpenAI's ``mcp_call`` item (the server label is
    the tool name's ``<server>__`` prefix)."""
    label = record.name.split(SEPARATOR, 1)[0] if SEPARATOR in record.name else ""
    return {
        "type": "mcp_call",
        "id": record.id,
        "server_label": label,
        "name": record.name,
        "arguments": record.arguments,
        "output": None if record.is_error else record.result,
        "error": record.result if record.is_error else None,
        "status": "completed",
    }


def output_items(message: ResponseMessage) -> list[dict[str, Any]]:
    items = [reasoning_item(message.reasoning_content)] if message.reasoning_content else []
    items += [mcp_item(record) for record in message.mcp_calls or []]
    if message.content:
        items.append(message_item(message.content))
    items += [call_item(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return items


def output_messages(output: list[dict[str, Any]]) -> list[ChatMessage]:
    """The output items as the messages a follow-up's conversation holds: the MCP calls the server
    ran (each call and its result), then the assistant's turn."""
    messages = input_messages([item for item in output if item["type"] == "mcp_call"])
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    reasoning = "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])
    calls = [
        {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in output
        if i["type"] == "function_call"
    ]
    return [
        *messages,
        ChatMessage(role="assistant", content=text, tool_calls=calls or None, reasoning_content=reasoning or None),
    ]


def response_usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = (usage.prompt_tokens_details or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens_details": {"reasoning_tokens": 0},
    }


def input_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's input as items with ids (a string is one user message)."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}]
    return [
        {"id": new_item_id("msg" if item.get("type", "message") == "message" else "item"), "type": "message", **item}
        for item in items
    ]
