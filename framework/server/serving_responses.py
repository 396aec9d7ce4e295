"""``/v1/responses``: OpenAI's Responses API on the chat pipeline.

``POST`` runs the request as a chat request (:mod:`framework.server.responses_input`) and answers
a response object whose ``output`` holds a ``reasoning`` item (from the reasoning parser), a
``message`` item and ``function_call`` items; streamed, it sends the typed events
(``response.created`` … ``response.output_text.delta`` … ``response.completed``). With ``store``
(the default) the response is kept (:class:`~framework.server.responses_store.ResponseStore`) for
``GET`` / ``DELETE`` and for a later request's ``previous_response_id``; ``background`` answers at
once (``queued``) and generates in a task that ``POST /v1/responses/{id}/cancel`` cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response

from framework.server.errors import APIError, decode_body
from framework.server.limits import read_body
from framework.server.mcp_client import SEPARATOR
from framework.server.protocol import ChatCompletionRequest, ChatMessage, MCPCallRecord, ResponseMessage, Usage
from framework.server.responses_input import (
    ResponsesRequest,
    chat_request,
    input_messages,
    reject_unsupported_responses,
)
from framework.server.responses_store import StoredResponse
from framework.server.serving_chat import ChatCall, chat_chunk_stream, chat_completion, start_chat, stream_response
from framework.server.state import ServerState, engine_error, new_id, typed_sse_stream


def _item_id(prefix: str) -> str:
    return new_id(prefix).replace("-", "_")


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or _item_id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or _item_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _item_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def mcp_item(record: MCPCallRecord) -> dict[str, Any]:
    """A call the server ran (``mcp_execute``), as OpenAI's ``mcp_call`` item (the server label is
    the tool name's ``<server>__`` prefix)."""
    label = record.name.split(SEPARATOR, 1)[0] if SEPARATOR in record.name else ""
    return {"type": "mcp_call", "id": record.id, "server_label": label, "name": record.name,
            "arguments": record.arguments, "output": None if record.is_error else record.result,
            "error": record.result if record.is_error else None, "status": "completed"}


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
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    return [*messages, ChatMessage(role="assistant", content=text, tool_calls=calls or None,
                                   reasoning_content=reasoning or None)]


def response_usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = (usage.prompt_tokens_details or {}).get("cached_tokens", 0)
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": 0}}


class ResponseRun:
    """One response being made: the request, its id, and the response object at each stage."""

    def __init__(self, state: ServerState, body: ResponsesRequest, chat: ChatCompletionRequest, conversation_start: int):
        self.state, self.body, self.chat = state, body, chat
        self.id = _item_id("resp")
        self.created_at = int(time.time())
        self.conversation = chat.messages[conversation_start:]  # without the instructions

    def response(self, status: str, output: list[dict[str, Any]] | None = None, usage: Usage | None = None,
                 finish_reason: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        if incomplete is not None and status == "completed":
            status = "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.state.model_name, "output": output or [], "usage": response_usage(usage),
                "error": error, "incomplete_details": incomplete, "instructions": body.instructions,
                "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
                "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
                "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
                "previous_response_id": body.previous_response_id, "metadata": body.metadata or {},
                "text": body.text or {"format": {"type": "text"}}, "reasoning": body.reasoning,
                "store": body.store, "background": body.background, "truncation": "disabled"}

    def store(self, response: dict[str, Any], task: asyncio.Task | None = None) -> None:
        if self.body.store:
            messages = [*self.conversation, *output_messages(response["output"])]
            self.state.responses.put(self.id, StoredResponse(response, messages, task))

    async def whole(self, call: ChatCall, request: Request | None) -> dict[str, Any]:
        completion = await chat_completion(call, request)
        choice = completion.choices[0]
        response = self.response("completed", output_items(choice.message), completion.usage, choice.finish_reason)
        self.store(response)
        return response


async def create_response(state: ServerState, request: Request) -> Response:
    arrival = time.perf_counter()
    body = decode_body(await read_body(request, state.config.request_body_timeout_s), ResponsesRequest)
    state.check_model(body.model)
    reject_unsupported_responses(body)
    history: list[ChatMessage] = []
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id)
        if previous is None:
            raise APIError(404, f"Previous response with id {body.previous_response_id!r} not found (responses are "
                                f"kept {state.config.stored_response_ttl_s:g} s, at most "
                                f"{state.config.max_stored_responses}, and only with 'store': true)",
                           param="previous_response_id", code="previous_response_not_found")
        if previous.task is not None and not previous.task.done():
            raise APIError(400, f"Previous response {body.previous_response_id!r} is still in progress",
                           param="previous_response_id", code="previous_response_in_progress")
        history = list(previous.messages)
    chat = chat_request(body, history)
    run = ResponseRun(state, body, chat, 1 if body.instructions else 0)
    call = start_chat(state, chat, arrival, id_prefix="resp")
    if body.background:
        queued = run.response("queued")
        run.store(queued, asyncio.create_task(_background(run, call)))
        return Response(queued)
    if body.stream:
        chunks, events = await chat_chunk_stream(call, include_usage=True)
        typed = stream_events(run, chunks)
        return stream_response(typed_sse_stream(typed, _error_event), call, typed, chunks, events)
    return Response(await run.whole(call, request))


async def _background(run: ResponseRun, call: ChatCall) -> None:
    run.store(run.response("in_progress"), asyncio.current_task())
    try:
        await run.whole(call, None)
    except asyncio.CancelledError:
        call.release()
        run.store(run.response("cancelled"))
        raise
    except Exception as error:
        api_error = engine_error(error)
        run.store(run.response("failed", error={"code": api_error.code or "server_error", "message": api_error.message}))


def _stored(state: ServerState, response_id: str) -> StoredResponse:
    entry = state.responses.get(response_id)
    if entry is None:
        raise APIError(404, f"No response with id {response_id!r} (responses are kept "
                            f"{state.config.stored_response_ttl_s:g} s, and only with 'store': true)",
                       param="response_id", code="response_not_found")
    return entry


def get_response(state: ServerState, response_id: str) -> dict[str, Any]:
    return _stored(state, response_id).response


def delete_response(state: ServerState, response_id: str) -> dict[str, Any]:
    _stored(state, response_id)
    state.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


async def cancel_response(state: ServerState, response_id: str) -> dict[str, Any]:
    entry = _stored(state, response_id)
    if not entry.response.get("background"):
        raise APIError(400, "only a background response can be cancelled", param="response_id", code="invalid_value")
    if entry.task is not None and not entry.task.done():
        entry.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await entry.task
    return _stored(state, response_id).response


def _error_event(error: APIError) -> dict[str, Any]:
    return {"type": "error", "code": error.code, "message": error.message, "param": error.param}


async def stream_events(run: ResponseRun, chunks: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
    """The typed events of a streamed response, from the chat pipeline's chunks.

    One output item is open at a time: a reasoning item while reasoning text comes, a message
    item while content comes, a function_call item per call; a new kind closes the open one.
    """
    sequence = 0
    output: list[dict[str, Any]] = []
    open_item: dict[str, Any] | None = None
    text = ""

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        nonlocal sequence
        sequence += 1
        return {"type": kind, "sequence_number": sequence - 1, **fields}

    def close() -> list[dict[str, Any]]:
        nonlocal open_item, text
        item, events = open_item, []
        if item is None:
            return events
        index = len(output)
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            item["arguments"] = text
            events.append(event("response.function_call_arguments.done", **where, name=item["name"], arguments=text))
        else:
            part = ({"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                    if item["type"] == "message" else {"type": "reasoning_text", "text": text})
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            events.append(event(f"response.{kind}.done", **where, content_index=0, text=text,
                                **({"logprobs": []} if kind == "output_text" else {})))
            events.append(event("response.content_part.done", **where, content_index=0, part=part))
            item["content"] = [part]
        item["status"] = "completed"
        output.append(item)
        events.append(event("response.output_item.done", output_index=index, item=item))
        open_item, text = None, ""
        return events

    def open_(item: dict[str, Any]) -> list[dict[str, Any]]:
        nonlocal open_item
        events = close()
        open_item = item
        index = len(output)
        events.append(event("response.output_item.added", output_index=index, item=dict(item)))
        if item["type"] != "function_call":
            part = ({"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    if item["type"] == "message" else {"type": "reasoning_text", "text": ""})
            events.append(event("response.content_part.added", item_id=item["id"], output_index=index,
                                content_index=0, part=part))
        return events

    yield event("response.created", response=run.response("in_progress"))
    yield event("response.in_progress", response=run.response("in_progress"))
    usage, finish_reason = None, None
    try:
        async for chunk in chunks:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                delta = choice.delta
                finish_reason = choice.finish_reason or finish_reason
                if delta.reasoning_content:
                    if open_item is None or open_item["type"] != "reasoning":
                        for e in open_(reasoning_item("", "in_progress")):
                            yield e
                    text += delta.reasoning_content
                    yield event("response.reasoning_text.delta", item_id=open_item["id"], output_index=len(output),
                                content_index=0, delta=delta.reasoning_content)
                if delta.content:
                    if open_item is None or open_item["type"] != "message":
                        for e in open_(message_item("", "in_progress")):
                            yield e
                    text += delta.content
                    yield event("response.output_text.delta", item_id=open_item["id"], output_index=len(output),
                                content_index=0, delta=delta.content, logprobs=[])
                for record in delta.mcp_calls or []:  # calls the server ran between two rounds
                    for e in close():
                        yield e
                    item = mcp_item(record)
                    yield event("response.output_item.added", output_index=len(output), item=item)
                    output.append(item)
                    yield event("response.output_item.done", output_index=len(output) - 1, item=item)
                for call in delta.tool_calls or []:
                    if call.id is not None:
                        for e in open_(call_item(call.id, call.function.name or "", "", "in_progress")):
                            yield e
                    piece = call.function.arguments if call.function is not None else None
                    if piece:
                        text += piece
                        yield event("response.function_call_arguments.delta", item_id=open_item["id"],
                                    output_index=len(output), delta=piece)
        for e in close():
            yield e
    except Exception as error:
        api_error = engine_error(error)
        failed = run.response("failed", output, error={"code": api_error.code or "server_error",
                                                       "message": api_error.message})
        yield event("response.failed", response=failed)
        return
    completed = run.response("completed", output, usage, finish_reason)
    run.store(completed)
    yield event("response.completed" if completed["status"] == "completed" else "response.incomplete",
                response=msgspec.to_builtins(completed))
