"""The chunks of a streamed chat completion: each engine delta parsed into content, reasoning and
tool-call pieces, MCP rounds run in between when ``mcp_execute`` asks, usage at the end."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from framework.parsers.base import ToolCallDelta, ToolParseDelta, assemble
from framework.server.chat_prompt import chat_logprobs
from framework.server.chat_tools import ParsedDelta
from framework.server.chat_turn import ChatTurn, MCPRounds
from framework.server.generation import ChoiceDelta
from framework.server.protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    Usage,
)
from framework.server.state import ServerState


def delta_message(parsed: ParsedDelta, sent_calls: set[int]) -> DeltaMessage | None:
    """The chunk delta of one parsed piece of a choice (``None`` when it holds nothing): a tool
    call's id, type and name go out with its first piece only (``sent_calls`` records the indices sent)."""
    calls = []
    for piece in parsed.tool_calls:
        first = piece.index not in sent_calls
        sent_calls.add(piece.index)
        calls.append(
            DeltaToolCall(
                index=piece.index,
                id=piece.id if first else None,
                type="function" if first else None,
                function=DeltaFunctionCall(name=piece.name if first else None, arguments=piece.arguments),
            )
        )
    if not (parsed.content or parsed.reasoning or calls):
        return None
    return DeltaMessage(
        content=parsed.content or None,
        reasoning_content=parsed.reasoning or None,
        reasoning=parsed.reasoning or None,
        tool_calls=calls or None,
    )


async def chat_chunks(
    state: ServerState,
    request_id: str,
    turn: ChatTurn,
    arrival: float,
    include_usage: bool,
    first_events: AsyncIterator[ChoiceDelta],
) -> AsyncIterator[ChatCompletionChunk]:
    """The SSE chunks of a streamed chat request.

    ``first_events`` are the first round's (already started). With ``mcp_execute``, tool calls
    are held until the round ends: if they are all MCP tools the
    server runs them, sends them with their results as ``delta.mcp_calls`` and streams the next
    round (its text after a blank line); otherwise the calls are sent whole, then the finish.
    """
    created = int(time.time())
    model, tokenizer, n = state.model_name, state.client.tokenizer, turn.params.n
    sent_calls: list[set[int]] = [set() for _ in range(n)]
    executing = turn.body.mcp_execute
    rounds = MCPRounds(state, request_id, turn, arrival, first_events)

    def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, model=model, created=created, choices=choices, usage=usage)

    for i in range(n):
        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
    completion_tokens = num_cached = 0
    has_content = False
    while True:
        turn = rounds.turn
        held: list[ToolCallDelta] = []
        round_content, calls, round_cached = "", [], 0
        async with contextlib.aclosing(rounds.events()) as events:
            async for delta in events:
                completion_tokens += len(delta.token_ids)
                round_cached = max(round_cached, delta.num_cached_tokens)
                parser = turn.parsers[delta.index]
                finish_reason = delta.finish_reason
                if parser is None:
                    parsed = ParsedDelta(content=delta.text)
                else:
                    parsed = parser.feed(delta.text)
                    if finish_reason is not None:
                        tail = parser.finish()
                        parsed = ParsedDelta(
                            parsed.reasoning + tail.reasoning,
                            parsed.content + tail.content,
                            parsed.tool_calls + tail.tool_calls,
                        )
                        if parser.has_tool_calls and finish_reason == "stop" and turn.calls_finish:
                            finish_reason = "tool_calls"
                if executing:
                    held += parsed.tool_calls
                    parsed.tool_calls = []
                    if parsed.content and rounds.index and has_content and not round_content:
                        parsed.content = "\n\n" + parsed.content  # a later round's text after a blank line
                    round_content += parsed.content
                has_content = has_content or bool(parsed.content)
                calls = assemble([ToolParseDelta(tool_calls=held)]).tool_calls if finish_reason and held else []
                if rounds.runs(calls):
                    finish_reason = None  # the server runs these calls and goes on
                elif calls:
                    parsed.tool_calls = [ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(calls)]
                    calls = []
                message = delta_message(parsed, sent_calls[delta.index])
                if message is not None or finish_reason is not None or delta.logprobs is not None:
                    yield chunk(
                        [
                            ChatStreamChoice(
                                index=delta.index,
                                delta=message or DeltaMessage(content=""),
                                logprobs=chat_logprobs(tokenizer, delta.logprobs, delta.token_ids),
                                finish_reason=finish_reason,
                                stop_reason=delta.stop_reason,
                            )
                        ]
                    )
        num_cached += round_cached  # summed over rounds, as prompt_tokens is
        if not calls:
            break
        records = await rounds.run_calls(round_content.strip(), calls)
        yield chunk([ChatStreamChoice(index=0, delta=DeltaMessage(mcp_calls=records))])
    prompt_tokens = rounds.prompt_tokens
    if include_usage:
        yield chunk([], Usage.counted(prompt_tokens, completion_tokens, num_cached))
