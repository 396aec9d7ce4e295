"""The OpenAI Responses API request, and its translation into a chat request.

A Responses request becomes a :class:`~framework.server.protocol.ChatCompletionRequest` (so it
runs the chat pipeline: template, parsers, structured outputs, MCP): ``instructions`` is a system
message, the input items become messages (``function_call`` items an assistant turn's
``tool_calls``, ``function_call_output`` items ``tool`` messages, ``reasoning`` items the next
assistant turn's ``reasoning_content``), ``tools`` / ``tool_choice`` / ``text.format`` /
``reasoning.effort`` their chat counterparts. Fields fw cannot honour are a 400 naming them.
"""

from __future__ import annotations

from typing import Any

from framework.server.chat_prompt import refuse_fields
from framework.server.errors import APIError, bad_request
from framework.server.protocol import ChatCompletionRequest, ChatMessage, MCPExecuteFields

#: Responses fields fw refuses when set (not None, and not a value in :data:`RESPONSES_DEFAULTS`).
UNSUPPORTED_RESPONSES_FIELDS = (
    "conversation",
    "prompt",
    "top_logprobs",
    "max_tool_calls",
    "context_management",
    "background_options",
    "moderation",
    "image",
    "access_programs",
    "include",
    "truncation",
    "service_tier",
    "prompt_cache_retention",
    "prompt_cache_options",
)
#: Values of refused fields that ask for what fw does anyway.
RESPONSES_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "include": ([],),
    "truncation": ("disabled",),
    "service_tier": ("auto", "default"),
}
#: Message content parts that are text.
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class ResponsesRequest(MCPExecuteFields, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]] = []
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # fw caches prompt prefixes by content anyway
    # vLLM-style sampling extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    # refused when set (UNSUPPORTED_RESPONSES_FIELDS)
    conversation: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    background_options: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    include: Any = None
    truncation: Any = None
    service_tier: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None


def reject_unsupported_responses(body: ResponsesRequest) -> None:
    refuse_fields(body, UNSUPPORTED_RESPONSES_FIELDS, RESPONSES_DEFAULTS)
    if body.background and body.stream:
        raise APIError(
            400,
            "'background' with 'stream' is not supported by this server yet: create the response in "
            "the background and poll GET /v1/responses/{id}",
            param="background",
            code="unsupported_parameter",
        )
    if body.background and not body.store:
        raise bad_request("'background' needs 'store': true (the response is fetched by id)", "background")


def _text_of(content: Any, param: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise APIError(
                400,
                f"content part type {kind!r} is not supported (only {', '.join(TEXT_PARTS)})",
                param=f"{param}[{j}].type",
                code="unsupported_parameter",
            )
        texts.append(part.get("refusal") if kind == "refusal" else part.get("text", ""))
    return "\n".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """The input as chat messages (see the module docstring); errors name ``input[i]``."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    messages: list[ChatMessage] = []
    names: dict[str, str] = {}  # call_id -> function name, for the tool messages
    reasoning: str | None = None  # a reasoning item waiting for its assistant turn
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object", f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"input[{i}].role must be one of user, system, developer, assistant; got {role!r}",
                    f"input[{i}].role",
                )
            message = ChatMessage(role=role, content=_text_of(item.get("content", ""), f"input[{i}].content"))
            if role == "assistant" and reasoning is not None:
                message.reasoning_content, reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise bad_request(f"input[{i}] (a function_call) needs string 'call_id' and 'name'", f"input[{i}]")
            names[call_id] = name
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": item.get("arguments", "{}")},
            }
            last = messages[-1] if messages else None
            if last is None or last.role != "assistant":  # calls after an assistant text join that turn
                last = ChatMessage(role="assistant", content="", reasoning_content=reasoning)
                reasoning = None
                messages.append(last)
            last.tool_calls = [*(last.tool_calls or []), call]
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise bad_request(
                    f"input[{i}] (a function_call_output) needs a string 'call_id'", f"input[{i}].call_id"
                )
            output = _text_of(item.get("output", ""), f"input[{i}].output")
            messages.append(ChatMessage(role="tool", content=output, tool_call_id=call_id, name=names.get(call_id)))
        elif kind == "mcp_call":  # a call the server ran (mcp_execute): the call and its result
            call_id, name = item.get("id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise bad_request(f"input[{i}] (an mcp_call) needs string 'id' and 'name'", f"input[{i}]")
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": item.get("arguments", "{}")},
            }
            messages.append(ChatMessage(role="assistant", content="", tool_calls=[call], reasoning_content=reasoning))
            reasoning = None
            output = item.get("output") if item.get("error") is None else item.get("error")
            messages.append(ChatMessage(role="tool", content=str(output or ""), tool_call_id=call_id, name=name))
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "\n".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise APIError(
                400,
                f"input item type {kind!r} is not supported (message, function_call, "
                "function_call_output, reasoning, mcp_call)",
                param=f"input[{i}].type",
                code="unsupported_parameter",
            )
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat ``name`` / ``parameters``) as chat tools."""
    if tools is None:
        return None
    result = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise APIError(
                400,
                f"tools[{i}].type {kind!r} is not supported (only 'function'; MCP tools are the "
                "server's, fw serve --mcp-config)",
                param=f"tools[{i}].type",
                code="unsupported_parameter",
            )
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        result.append({"type": "function", "function": function})
    return result


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}", "tool_choice"
    )


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as a chat ``response_format``."""
    form = (text or {}).get("format")
    if form is None or form.get("type") == "text":
        return None
    if form.get("type") == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {key: form[key] for key in ("name", "schema", "strict") if key in form},
        }
    return form  # json_object, or an unknown type the chat pipeline refuses by name


def chat_request(body: ResponsesRequest, history: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request this Responses request runs as; ``history`` is the previous response's conversation."""
    messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    messages += history + input_messages(body.input)
    if not any(m.role != "system" for m in messages):
        raise bad_request("'input' must hold at least one message (or give previous_response_id)", "input")
    reasoning = body.reasoning or {}
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
        user=body.user,
        tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format(body.text),
        reasoning_effort=reasoning.get("effort"),
        stream=body.stream,
        mcp_execute=body.mcp_execute,
        mcp_max_rounds=body.mcp_max_rounds,
    )
