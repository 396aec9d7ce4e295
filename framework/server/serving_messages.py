"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API on the chat pipeline.

The request runs as a chat request (:mod:`framework.server.anthropic_input`); the reply's
reasoning (from the reasoning parser) is a ``thinking`` block, its text a ``text`` block, its
calls ``tool_use`` blocks. Streamed, it sends ``message_start``, then per block
``content_block_start`` / ``content_block_delta``... / ``content_block_stop``, then
``message_delta`` (stop reason, output tokens) and ``message_stop``. Errors use Anthropic's
envelope (:func:`framework.server.errors.anthropic_error_body`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response

from framework.server.anthropic_input import MessagesRequest, chat_request, reject_unsupported_messages
from framework.server.chat_prompt import chat_prompt, template_messages
from framework.server.chat_tools import tool_setup
from framework.server.errors import APIError, anthropic_error_body, decode_body
from framework.server.limits import read_body
from framework.server.mcp_client import SEPARATOR
from framework.server.protocol import MCPCallRecord, ResponseMessage
from framework.server.serving_chat import ChatCall, chat_chunk_stream, chat_completion, start_chat, stream_response
from framework.server.state import ServerState, engine_error, typed_sse_stream

#: chat finish reasons -> Anthropic stop reasons (a matched stop string is ``stop_sequence``)
STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens", "abort": "end_turn"}


def stop_reason(finish_reason: str | None, stop: int | str | None) -> tuple[str, str | None]:
    """The Anthropic ``stop_reason`` and ``stop_sequence`` of a finished reply."""
    if finish_reason == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def tool_input(arguments: str) -> Any:
    try:
        return json.loads(arguments or "{}")
    except ValueError:  # the model wrote arguments that are not JSON: passed on as text
        return {"_raw_arguments": arguments}


def mcp_blocks(record: MCPCallRecord) -> list[dict[str, Any]]:
    """A call the server ran (``mcp_execute``), as the MCP connector's ``mcp_tool_use`` and
    ``mcp_tool_result`` blocks (the server name is the tool name's ``<server>__`` prefix)."""
    server = record.name.split(SEPARATOR, 1)[0] if SEPARATOR in record.name else ""
    return [
        {
            "type": "mcp_tool_use",
            "id": record.id,
            "name": record.name,
            "server_name": server,
            "input": tool_input(record.arguments),
        },
        {
            "type": "mcp_tool_result",
            "tool_use_id": record.id,
            "is_error": record.is_error,
            "content": [{"type": "text", "text": record.result}],
        },
    ]


def content_blocks(message: ResponseMessage) -> list[dict[str, Any]]:
    blocks = (
        [{"type": "thinking", "thinking": message.reasoning_content, "signature": ""}]
        if message.reasoning_content
        else []
    )
    blocks += [block for record in message.mcp_calls or [] for block in mcp_blocks(record)]
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    blocks += [
        {"type": "tool_use", "id": c.id, "name": c.function.name, "input": tool_input(c.function.arguments)}
        for c in message.tool_calls or []
    ]
    return blocks


def usage(input_tokens: int, output_tokens: int, cached: int = 0) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` excludes the prompt tokens read from the prefix cache."""
    return {
        "input_tokens": input_tokens - cached,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _message(
    call: ChatCall, content: list[dict[str, Any]], reason: str | None, sequence: str | None, tokens: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": call.request_id.replace("-", "_"),
        "type": "message",
        "role": "assistant",
        "model": call.state.model_name,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": tokens,
    }


async def create_message(state: ServerState, request: Request) -> Response:
    arrival = time.perf_counter()
    body = decode_body(await read_body(request, state.config.request_body_timeout_s), MessagesRequest)
    state.check_model(body.model)
    reject_unsupported_messages(body)
    call = start_chat(state, chat_request(body), arrival, id_prefix="msg")
    if body.stream:
        chunks, events = await chat_chunk_stream(call, include_usage=True)
        typed = stream_events(call, chunks)
        return stream_response(typed_sse_stream(typed, _error_event), call, typed, chunks, events)
    completion = await chat_completion(call, request)
    choice = completion.choices[0]
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
    tokens = completion.usage
    cached = (tokens.prompt_tokens_details or {}).get("cached_tokens", 0)
    return Response(
        _message(
            call,
            content_blocks(choice.message),
            reason,
            sequence,
            usage(tokens.prompt_tokens, tokens.completion_tokens, cached),
        )
    )


async def count_tokens(state: ServerState, request: Request) -> dict[str, int]:
    """The prompt's length in tokens, as ``/v1/messages`` would render it (tools and system included)."""
    body = decode_body(await read_body(request, state.config.request_body_timeout_s), MessagesRequest)
    state.check_model(body.model)
    reject_unsupported_messages(body)
    chat = chat_request(body, for_generation=False)
    setup = tool_setup(chat)
    _, ids = chat_prompt(state.client.tokenizer, chat, setup.tools, template_messages(chat.messages))
    return {"input_tokens": len(ids)}


def _error_event(error: APIError) -> dict[str, Any]:
    return anthropic_error_body(error)


async def stream_events(call: ChatCall, chunks: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
    """The Messages stream's events, from the chat pipeline's chunks: one content block open at a
    time (thinking, text, or one tool_use), a new kind closing the open one."""
    index = -1
    kind: str | None = None  # the open block's type
    num_prompt = len(call.turn.prompt_ids)
    yield {"type": "message_start", "message": _message(call, [], None, None, usage(num_prompt, 0))}
    yield {"type": "ping"}

    def start(block: dict[str, Any]) -> list[dict[str, Any]]:
        nonlocal index, kind
        events = [{"type": "content_block_stop", "index": index}] if kind is not None else []
        index, kind = index + 1, block["type"]
        events.append({"type": "content_block_start", "index": index, "content_block": block})
        return events

    final, finish, stop = usage(num_prompt, 0), None, None
    try:
        async for chunk in chunks:
            if chunk.usage is not None:  # the last chunk: the whole request's usage
                cached = (chunk.usage.prompt_tokens_details or {}).get("cached_tokens", 0)
                final = usage(chunk.usage.prompt_tokens, chunk.usage.completion_tokens, cached)
            for choice in chunk.choices:
                delta = choice.delta
                if choice.finish_reason is not None:
                    finish, stop = choice.finish_reason, choice.stop_reason
                if delta.reasoning_content:
                    if kind != "thinking":
                        for event in start({"type": "thinking", "thinking": "", "signature": ""}):
                            yield event
                    yield {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "thinking_delta", "thinking": delta.reasoning_content},
                    }
                if delta.content:
                    if kind != "text":
                        for event in start({"type": "text", "text": ""}):
                            yield event
                    yield {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "text_delta", "text": delta.content},
                    }
                for record in delta.mcp_calls or []:  # calls the server ran between two rounds
                    for block in mcp_blocks(record):
                        for event in start(block):
                            yield event
                for piece in delta.tool_calls or []:
                    if piece.id is not None:
                        for event in start(
                            {"type": "tool_use", "id": piece.id, "name": piece.function.name, "input": {}}
                        ):
                            yield event
                    if piece.function is not None and piece.function.arguments:
                        yield {
                            "type": "content_block_delta",
                            "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": piece.function.arguments},
                        }
    except Exception as error:
        yield anthropic_error_body(engine_error(error))
        return
    if kind is not None:
        yield {"type": "content_block_stop", "index": index}
    reason, sequence = stop_reason(finish, stop)
    yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": final}
    yield {"type": "message_stop"}
