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
from typing import Any

from litestar import Request, Response

from framework.server.errors import APIError, decode_body
from framework.server.limits import read_body
from framework.server.protocol import ChatCompletionRequest, ChatMessage, Usage
from framework.server.responses_input import (
    ResponsesRequest,
    chat_request,
    reject_unsupported_responses,
)
from framework.server.responses_items import input_items, new_item_id, output_items, output_messages, response_usage
from framework.server.responses_store import StoredResponse
from framework.server.responses_stream import stream_events
from framework.server.serving_chat import ChatCall, chat_chunk_stream, chat_completion, start_chat, stream_response
from framework.server.state import ServerState, engine_error, typed_sse_stream


class ResponseRun:
    """One response being made: the request, its id, and the response object at each stage."""

    def __init__(
        self, state: ServerState, body: ResponsesRequest, chat: ChatCompletionRequest, conversation_start: int
    ):
        self.state, self.body, self.chat = state, body, chat
        self.id = new_item_id("resp")
        self.created_at = int(time.time())
        self.conversation = chat.messages[conversation_start:]  # without the instructions

    def response(
        self,
        status: str,
        output: list[dict[str, Any]] | None = None,
        usage: Usage | None = None,
        finish_reason: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        if incomplete is not None and status == "completed":
            status = "incomplete"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.state.model_name,
            "output": output or [],
            "usage": response_usage(usage),
            "error": error,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "metadata": body.metadata or {},
            "text": body.text or {"format": {"type": "text"}},
            "reasoning": body.reasoning,
            "store": body.store,
            "background": body.background,
            "truncation": "disabled",
        }

    def store(self, response: dict[str, Any], task: asyncio.Task | None = None) -> None:
        if self.body.store:
            messages = [*self.conversation, *output_messages(response["output"])]
            self.state.responses.put(
                self.id, StoredResponse(response, messages, task, input_items=input_items(self.body.input))
            )

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
            raise APIError(
                404,
                f"Previous response with id {body.previous_response_id!r} not found (responses are "
                f"kept {state.config.stored_response_ttl_s:g} s, at most "
                f"{state.config.max_stored_responses}, and only with 'store': true)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        if previous.task is not None and not previous.task.done():
            raise APIError(
                400,
                f"Previous response {body.previous_response_id!r} is still in progress",
                param="previous_response_id",
                code="previous_response_in_progress",
            )
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
        typed = stream_events(run, chunks)  # framework.server.responses_stream
        return stream_response(typed_sse_stream(typed, _error_event), call, typed, chunks, events)
    return Response(await run.whole(call, request))


async def _background(run: ResponseRun, call: ChatCall) -> None:
    run.store(run.response("in_progress"), asyncio.current_task())
    try:
        await run.whole(call, None)
    except asyncio.CancelledError:
        call.release()
        if run.state.responses.get(run.id) is not None:  # cancelled, not deleted or evicted: keep the status
            run.store(run.response("cancelled"))
        raise
    except Exception as error:
        api_error = engine_error(error)
        run.store(
            run.response("failed", error={"code": api_error.code or "server_error", "message": api_error.message})
        )


def _stored(state: ServerState, response_id: str) -> StoredResponse:
    entry = state.responses.get(response_id)
    if entry is None:
        raise APIError(
            404,
            f"No response with id {response_id!r} (responses are kept "
            f"{state.config.stored_response_ttl_s:g} s, and only with 'store': true)",
            param="response_id",
            code="response_not_found",
        )
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


def list_input_items(state: ServerState, response_id: str) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: the request's input items, newest first (as OpenAI lists them)."""
    items = list(reversed(_stored(state, response_id).input_items or []))
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": False,
    }


def _error_event(error: APIError) -> dict[str, Any]:
    return {"type": "error", "code": error.code, "message": error.message, "param": error.param}
