"""``POST /v1/chat/completions``: messages -> chat template -> tokens -> choices, streamed or not.

The pipeline is shared: :func:`start_chat` validates and admits any
:class:`~framework.server.protocol.ChatCompletionRequest` (the Responses and Messages APIs
translate theirs into one), then :func:`chat_completion` gives the whole reply and
:func:`chat_chunk_stream` the chunks (built in :mod:`~framework.server.chat_stream`), tools,
reasoning, structured outputs and MCP rounds included.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from litestar import Request, Response
from litestar.response import Stream

from framework.multimodal.inputs import ProcessedImage
from framework.parsers.base import ToolCall
from framework.server.chat_images import prepare_images_off_loop
from framework.server.chat_prompt import chat_logprobs, reject_unsupported, template_messages
from framework.server.chat_stream import chat_chunks
from framework.server.chat_tools import tool_setup
from framework.server.chat_turn import ChatTurn, MCPRounds
from framework.server.errors import APIError, bad_request, decode_body
from framework.server.generation import ChoiceDelta, ChoiceState, run_choices
from framework.server.limits import check_sampling_limits, read_body
from framework.server.protocol import (
    UNSUPPORTED_CHAT_FIELDS,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Usage,
)
from framework.server.state import Admission, ServerState, new_id, release_after, sse_stream, until_disconnect
from framework.server.structured_outputs import first_event_or_error, grammar_errors

#: The most tool-call rounds ``mcp_execute`` may run for one request (``mcp_max_rounds``).
MAX_MCP_ROUNDS = 16


@dataclass(slots=True)
class ChatCall:
    """One admitted chat request: its first turn and its admission (released once it is answered)."""

    state: ServerState
    request_id: str
    turn: ChatTurn
    arrival: float
    release: Admission


def start_chat(
    state: ServerState,
    body: ChatCompletionRequest,
    arrival: float,
    id_prefix: str = "chatcmpl",
    processed_images: list[ProcessedImage] | None = None,
) -> ChatCall:
    """Validate ``body`` (400s name the field), admit it (429 at capacity) and build its first turn
    (``processed_images``: its images, preprocessed by :func:`prepare_images_off_loop`)."""
    state.check_model(body.model)
    reject_unsupported(body, UNSUPPORTED_CHAT_FIELDS)
    check_sampling_limits(body, state.config.max_n)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    mcp = state.mcp
    setup = tool_setup(
        body,
        mcp.openai_tools() if mcp is not None else None,
        can_parse_calls=mcp is None or state.served_parsers().tool is not None,
    )
    if body.mcp_execute:
        if mcp is None:
            raise bad_request("'mcp_execute' needs MCP servers (fw serve --mcp-config / --mcp-command)", "mcp_execute")
        if not mcp.is_execution_enabled():
            raise APIError(
                400,
                "'mcp_execute' is not enabled on this server: the operator has not allowed clients to "
                'have its MCP tools run (fw serve --mcp-execute, or "execute": true for a server in '
                "--mcp-config)",
                param="mcp_execute",
                code="mcp_execute_disabled",
            )
        if body.n != 1:
            raise bad_request("'mcp_execute' works with requests of n = 1", "mcp_execute")
    if not 0 <= body.mcp_max_rounds <= MAX_MCP_ROUNDS:
        raise bad_request(
            f"'mcp_max_rounds' must be in [0, {MAX_MCP_ROUNDS}], got {body.mcp_max_rounds}", "mcp_max_rounds"
        )
    release = state.admit(max(body.n, 1))
    try:
        messages = template_messages(
            body.messages, allow_images=state.vision is not None, text_only_reason=state.text_only_reason
        )
        turn = ChatTurn(state, body, setup, messages, processed_images)
        release.add_tokens(len(turn.prompt_ids) * max(body.n, 1))
    except BaseException:
        release()
        raise
    return ChatCall(state, new_id(id_prefix), turn, arrival, release)


async def chat_completion(call: ChatCall, request: Request | None = None) -> ChatCompletionResponse:
    """The whole reply; with ``request``, a client that disconnects cancels it. Releases the admission."""
    work = _response(call.state, call.request_id, call.turn, call.arrival)
    to_api_error = grammar_errors(call.turn.grammar_field)
    try:
        if request is not None:
            return await until_disconnect(request, work, to_api_error)
        try:
            return await work
        except Exception as error:
            raise to_api_error(error) from None
    finally:
        call.release()


async def chat_chunk_stream(
    call: ChatCall, include_usage: bool = False
) -> tuple[AsyncGenerator[ChatCompletionChunk], AsyncGenerator[ChoiceDelta]]:
    """The reply's chunks, and the engine events under them (close both when done: :func:`stream_response`).

    An engine refusal of the request's grammar is raised here, as an HTTP error, not mid-stream."""
    state, turn = call.state, call.turn
    events = run_choices(
        state.client, call.request_id, [turn.prompt_ids], turn.params, state.metrics, call.arrival, turn.images
    )
    if turn.params.structured_outputs is not None:
        events = await first_event_or_error(events, call.release, grammar_errors(turn.grammar_field))
    return chat_chunks(state, call.request_id, turn, call.arrival, include_usage, events), events


def stream_response(body: AsyncIterator[bytes], call: ChatCall, *generators: AsyncGenerator) -> Stream:
    """An SSE response of ``body``; afterwards ``generators`` (outermost first) close and the admission is released."""
    return Stream(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
        background=release_after(call.release, body, *generators),
    )


async def create_chat_completion(state: ServerState, request: Request) -> Response | Stream:
    arrival = time.perf_counter()
    body = decode_body(await read_body(request, state.config.request_body_timeout_s), ChatCompletionRequest)
    call = start_chat(state, body, arrival, processed_images=await prepare_images_off_loop(state, body))
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks, events = await chat_chunk_stream(call, include_usage)
        return stream_response(sse_stream(chunks, finalize=call.release), call, chunks, events)
    return Response(await chat_completion(call, request))


async def _response(state: ServerState, request_id: str, turn: ChatTurn, arrival: float) -> ChatCompletionResponse:
    tokenizer = state.client.tokenizer
    rounds = MCPRounds(state, request_id, turn, arrival)
    completion_tokens = num_cached = 0
    contents: list[str] = []  # the text of earlier rounds, which a streaming client would have seen too
    while True:
        choices = [ChoiceState() for _ in range(rounds.turn.params.n)]
        round_cached = 0  # the round's prompt-cache hit (its choices share the prompt)
        async for delta in rounds.events():
            choices[delta.index].add(delta)
            round_cached = max(round_cached, delta.num_cached_tokens)
        num_cached += round_cached  # summed over rounds, as prompt_tokens is
        completion_tokens += sum(len(c.token_ids) for c in choices)
        results = [rounds.turn.message(i, c) for i, c in enumerate(choices)]
        message, _ = results[0]
        calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
        if not rounds.runs(calls):
            break
        await rounds.run_calls(message.content or "", calls)
        if message.content:
            contents.append(message.content)
    if contents:
        message.content = "\n\n".join(contents + [message.content or ""]).rstrip("\n")
    wants_logprobs = rounds.turn.body.logprobs
    response_choices = []
    for i, (c, (message, finish)) in enumerate(zip(choices, results)):
        if rounds.records and i == 0:
            message.mcp_calls = rounds.records
        response_choices.append(
            ChatChoice(
                index=i,
                message=message,
                finish_reason=finish,
                stop_reason=c.stop_reason,
                logprobs=chat_logprobs(tokenizer, c.logprobs if wants_logprobs else None, c.token_ids),
            )
        )
    prompt_tokens = rounds.prompt_tokens
    return ChatCompletionResponse(
        id=request_id,
        model=state.model_name,
        choices=response_choices,
        usage=Usage.counted(prompt_tokens, completion_tokens, num_cached),
    )
