"""The typed SSE events of a streamed ``/v1/responses`` request, made from the chat pipeline's chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec

from framework.server.responses_items import call_item, mcp_item, message_item, reasoning_item
from framework.server.state import engine_error

if TYPE_CHECKING:
    from framework.server.serving_responses import ResponseRun


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
            part = (
                {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                if item["type"] == "message"
                else {"type": "reasoning_text", "text": text}
            )
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            events.append(
                event(
                    f"response.{kind}.done",
                    **where,
                    content_index=0,
                    text=text,
                    **({"logprobs": []} if kind == "output_text" else {}),
                )
            )
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
            part = (
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                if item["type"] == "message"
                else {"type": "reasoning_text", "text": ""}
            )
            events.append(
                event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part)
            )
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
                for piece, kind in ((delta.reasoning_content, "reasoning"), (delta.content, "message")):
                    if not piece:
                        continue
                    if open_item is None or open_item["type"] != kind:
                        item = (
                            reasoning_item("", "in_progress")
                            if kind == "reasoning"
                            else message_item("", "in_progress")
                        )
                        for e in open_(item):
                            yield e
                    text += piece
                    extra = {"logprobs": []} if kind == "message" else {}
                    yield event(
                        "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta",
                        item_id=open_item["id"],
                        output_index=len(output),
                        content_index=0,
                        delta=piece,
                        **extra,
                    )
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
                        yield event(
                            "response.function_call_arguments.delta",
                            item_id=open_item["id"],
                            output_index=len(output),
                            delta=piece,
                        )
        for e in close():
            yield e
    except Exception as error:
        api_error = engine_error(error)
        failed = run.response(
            "failed", output, error={"code": api_error.code or "server_error", "message": api_error.message}
        )
        yield event("response.failed", response=failed)
        return
    completed = run.response("completed", output, usage, finish_reason)
    run.store(completed)
    yield event(
        "response.completed" if completed["status"] == "completed" else "response.incomplete",
        response=msgspec.to_builtins(completed),
    )
