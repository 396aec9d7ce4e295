"""The Anthropic Messages API request, and its translation into a chat request.

``system`` becomes a system message; a user turn's ``tool_result`` blocks become ``tool`` messages
(before the turn's text); an assistant turn's ``tool_use`` blocks its ``tool_calls`` and its
``thinking`` blocks its ``reasoning_content``; ``tools`` / ``tool_choice`` their chat counterparts;
``thinking`` reaches the template as ``enable_thinking``; ``stop_sequences`` are stop strings.
``output_config.effort`` reaches the template as ``reasoning_effort`` and ``output_config.format``
constrains the reply (structured outputs). ``cache_control`` marks are accepted and need nothing:
fw caches prompt prefixes by content. ``temperature``, ``top_p`` and ``top_k`` (dropped from
Anthropic's current API, still sent by older clients) are honoured.
Blocks and fields fw cannot honour are a 400 naming them.
"""

from __future__ import annotations

import json
from typing import Any

from framework.server.chat_prompt import refuse_fields
from framework.server.errors import APIError, bad_request
from framework.server.protocol import ChatCompletionRequest, ChatMessage, MCPExecuteFields

#: Fields fw refuses when set.
UNSUPPORTED_MESSAGES_FIELDS = (
    "container",
    "mcp_servers",
    "context_management",
    "output_format",
    "citations",
    "diagnostics",
    "inference_geo",
)


class MessagesRequest(MCPExecuteFields, kw_only=True):
    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # required by /v1/messages, not by count_tokens
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # accepted: fw caches prompt prefixes anyway
    speed: str | None = None
    # refused when set
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    output_format: Any = None
    citations: Any = None
    diagnostics: Any = None
    inference_geo: Any = None


def reject_unsupported_messages(body: MessagesRequest) -> None:
    refuse_fields(body, UNSUPPORTED_MESSAGES_FIELDS, {})
    if body.service_tier not in (None, "auto", "standard_only"):
        raise bad_request(f"service_tier must be 'auto' or 'standard_only'; got {body.service_tier!r}", "service_tier")
    if body.speed not in (None, "standard"):
        raise APIError(
            400,
            f"speed {body.speed!r} is not supported by this server (only 'standard')",
            param="speed",
            code="unsupported_parameter",
        )
    unknown = set(body.output_config or {}) - {"effort", "format"}
    if unknown:
        raise APIError(
            400,
            f"output_config.{sorted(unknown)[0]} is not supported (effort, format)",
            param=f"output_config.{sorted(unknown)[0]}",
            code="unsupported_parameter",
        )


def _text(blocks: str | list[dict[str, Any]], param: str) -> str:
    """Text blocks (or a string) as one string."""
    if isinstance(blocks, str):
        return blocks
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise APIError(
                400,
                f"content block type {kind!r} is not supported here (only 'text')",
                param=f"{param}[{j}].type",
                code="unsupported_parameter",
            )
        texts.append(block.get("text", ""))
    return "\n".join(texts)


def chat_messages(body: MessagesRequest) -> list[ChatMessage]:
    """``system`` and ``messages`` as chat messages (see the module docstring); errors name the block."""
    messages = [ChatMessage(role="system", content=_text(body.system, "system"))] if body.system else []
    names: dict[str, str] = {}  # tool_use id -> tool name
    for i, message in enumerate(body.messages):
        role, content = message.get("role"), message.get("content", "")
        if role not in ("user", "assistant"):
            raise bad_request(f"messages[{i}].role must be 'user' or 'assistant'; got {role!r}", f"messages[{i}].role")
        if isinstance(content, str):
            messages.append(ChatMessage(role=role, content=content))
            continue
        if not isinstance(content, list):
            raise bad_request(
                f"messages[{i}].content must be a string or a list of content blocks", f"messages[{i}].content"
            )
        texts, calls, thinking, results, ran = [], [], [], [], []
        for j, block in enumerate(content):
            kind, param = block.get("type") if isinstance(block, dict) else None, f"messages[{i}].content[{j}]"
            if kind == "text":
                texts.append(block.get("text", ""))
            elif kind == "tool_use" and role == "assistant":
                call_id, name = block.get("id"), block.get("name")
                if not isinstance(call_id, str) or not isinstance(name, str):
                    raise bad_request(f"{param} (tool_use) needs string 'id' and 'name'", param)
                names[call_id] = name
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)},
                    }
                )
            elif kind == "mcp_tool_use" and role == "assistant":  # a call the server ran (mcp_execute)
                call = {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {
                        "name": block.get("name"),
                        "arguments": json.dumps(block.get("input", {}), ensure_ascii=False),
                    },
                }
                names[str(block.get("id"))] = str(block.get("name"))
                ran.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
            elif kind == "mcp_tool_result" and role == "assistant":
                call_id = str(block.get("tool_use_id"))
                ran.append(
                    ChatMessage(
                        role="tool",
                        content=_text(block.get("content", ""), f"{param}.content"),
                        tool_call_id=call_id,
                        name=names.get(call_id),
                    )
                )
            elif kind == "thinking" and role == "assistant":
                thinking.append(block.get("thinking", ""))
            elif kind == "tool_result" and role == "user":
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str):
                    raise bad_request(f"{param} (tool_result) needs a string 'tool_use_id'", f"{param}.tool_use_id")
                result = _text(block.get("content", ""), f"{param}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                results.append(ChatMessage(role="tool", content=result, tool_call_id=call_id, name=names.get(call_id)))
            else:
                raise APIError(
                    400,
                    f"content block type {kind!r} is not supported in a {role} message (user: text, "
                    "tool_result; assistant: text, tool_use, thinking, mcp_tool_use, mcp_tool_result)",
                    param=f"{param}.type",
                    code="unsupported_parameter",
                )
        messages += results + ran
        if role == "assistant":
            messages.append(
                ChatMessage(
                    role=role,
                    content="".join(texts),
                    tool_calls=calls or None,
                    reasoning_content="".join(thinking) or None,
                )
            )
        elif texts or not results:
            messages.append(ChatMessage(role=role, content="\n".join(texts)))
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Client tools (``name`` / ``description`` / ``input_schema``) as chat tools; server tools are refused."""
    if tools is None:
        return None
    result = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "name" not in tool:
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(
                400,
                f"tools[{i}]: tool type {kind!r} is not supported (only client tools with 'name' and 'input_schema')",
                param=f"tools[{i}].type",
                code="unsupported_parameter",
            )
        function = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        result.append({"type": "function", "function": function})
    return result


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """``tool_choice`` as the chat tool_choice and parallel_tool_calls."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise bad_request(f"tool_choice.type must be auto, any, tool or none; got {kind!r}", "tool_choice.type")


def thinking_kwargs(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    """``thinking`` as the template's ``enable_thinking``."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise bad_request(
            f"thinking.type must be enabled, disabled, adaptive or between_tools; got {kind!r}", "thinking.type"
        )
    return {"enable_thinking": kind != "disabled"}


def chat_request(body: MessagesRequest, *, for_generation: bool = True) -> ChatCompletionRequest:
    """The chat request this Messages request runs as."""
    if for_generation:
        if body.max_tokens is None:
            raise APIError(
                400, "missing required parameter 'max_tokens'", param="max_tokens", code="missing_required_parameter"
            )
        if body.max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1, got {body.max_tokens}", "max_tokens")
    if not body.messages:
        raise bad_request("'messages' must hold at least one message", "messages")
    tool_choice, parallel = chat_tool_choice(body.tool_choice)
    user = (body.metadata or {}).get("user_id")
    output = body.output_config or {}
    form = output.get("format")
    if form is not None and (not isinstance(form, dict) or form.get("type") != "json_schema"):
        raise bad_request(
            'output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config.format"
        )
    response_format = (
        None
        if form is None
        else {"type": "json_schema", "json_schema": {"name": "output", "schema": form.get("schema")}}
    )
    effort = output.get("effort")
    return ChatCompletionRequest(
        model=body.model,
        messages=chat_messages(body),
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences,
        tools=chat_tools(body.tools),
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=thinking_kwargs(body.thinking),
        user=user if isinstance(user, str) else None,
        stream=body.stream,
        response_format=response_format,
        reasoning_effort={"max": "xhigh"}.get(effort, effort),
        mcp_execute=body.mcp_execute,
        mcp_max_rounds=body.mcp_max_rounds,
    )
