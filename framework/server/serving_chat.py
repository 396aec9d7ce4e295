"""``POST /v1/chat/completions``: messages -> chat template -> tokens -> choices, streamed or not."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response
from litestar.response import Stream

from framework.engine.outputs import LogprobEntry
from framework.errors import ConfigError
from framework.parsers.base import ToolCall, ToolCallDelta, ToolParseDelta, assemble
from framework.server.chat_tokens import encode_chat
from framework.server.chat_tools import (
    ParsedDelta,
    ToolSetup,
    after_reasoning,
    choice_parser,
    structured_outputs_for,
    template_tool_calls,
    tool_setup,
)
from framework.server.errors import APIError, bad_request, decode_body
from framework.server.generation import ChoiceDelta, ChoiceState, build_sampling_params, run_choices
from framework.server.limits import check_sampling_limits, read_body
from framework.server.protocol import (
    DEFAULT_VALUES,
    UNSUPPORTED_CHAT_FIELDS,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    MCPCallRecord,
    ResponseMessage,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from framework.server.state import ServerState, new_id, release_after, sse_stream, until_disconnect
from framework.server.structured_outputs import first_event_or_error, grammar_errors, structured_outputs_field
from framework.server.template_tools import with_generic_tools
from framework.tokenizer import Tokenizer

#: The most tool-call rounds ``mcp_execute`` may run for one request (``mcp_max_rounds``).
MAX_MCP_ROUNDS = 16


def reject_unsupported(body: Any, names: tuple[str, ...]) -> None:
    """A field fw does not support yet is a 400 naming it, never silently ignored (unless it is
    set to the value that asks for what fw does anyway, :data:`DEFAULT_VALUES`)."""
    for name in names:
        value = getattr(body, name)
        if value is not None and not any(
            type(value) is type(ok) and value == ok for ok in DEFAULT_VALUES.get(name, ())
        ):
            raise APIError(
                400, f"{name!r} is not supported by this server yet", param=name, code="unsupported_parameter"
            )
    options = getattr(body, "stream_options", None)
    if options is not None and options.continuous_usage_stats:
        raise APIError(
            400,
            "'stream_options.continuous_usage_stats' is not supported by this server yet; "
            "'include_usage' sends the usage at the end",
            param="stream_options.continuous_usage_stats",
            code="unsupported_parameter",
        )
    if getattr(body, "best_of", None) not in (None, 1, getattr(body, "n", 1)):
        raise APIError(
            400, "'best_of' is not supported by this server yet", param="best_of", code="unsupported_parameter"
        )


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them; content parts are joined text."""
    if not messages:
        raise bad_request("'messages' must hold at least one message", "messages")
    result = []
    for i, message in enumerate(messages):
        if message.role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(
                f"messages[{i}].role must be one of system, developer, user, assistant, tool; got {message.role!r}",
                f"messages[{i}].role",
            )
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400,
                        f"content part type {part.get('type')!r} is not supported (only 'text')",
                        param=f"messages[{i}].content[{j}].type",
                        code="unsupported_parameter",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        item: dict[str, Any] = {"role": message.role, "content": content or ""}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(message, key) is not None:
                item[key] = getattr(message, key)
        if message.tool_calls is not None:
            item["tool_calls"] = template_tool_calls(message.tool_calls)
        if message.reasoning is not None and message.reasoning_content is None:
            item["reasoning_content"] = message.reasoning
        result.append(item)
    return result


def chat_prompt_text(
    tokenizer: Tokenizer,
    body: ChatCompletionRequest,
    tools: list[dict[str, Any]] | None = None,
    messages: list[dict[str, Any]] | None = None,
) -> str:
    """The rendered prompt: the messages (and ``tools``) through the model's chat template."""
    messages = template_messages(body.messages) if messages is None else messages
    kwargs = dict(body.chat_template_kwargs or {})
    add_generation_prompt = kwargs.pop("add_generation_prompt", body.add_generation_prompt)
    kwargs.pop("tools", None)
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
    except ConfigError as error:
        raise bad_request(str(error), "messages") from None
    except Exception as error:  # jinja2 errors from the model's own template
        raise bad_request(f"the chat template failed on these messages: {error}", "messages") from None


def chat_prompt(
    tokenizer: Tokenizer,
    body: ChatCompletionRequest,
    tools: list[dict[str, Any]] | None = None,
    messages: list[dict[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    """The rendered prompt and its token ids, the client's text kept out of the control tokens
    (:func:`framework.server.chat_tokens.encode_chat`)."""
    messages = template_messages(body.messages) if messages is None else messages
    return encode_chat(
        tokenizer,
        messages,
        lambda shaped: chat_prompt_text(tokenizer, body, tools, shaped),
        {"tools": tools, "chat_template_kwargs": body.chat_template_kwargs},
    )


def chat_prompt_ids(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[int]:
    return chat_prompt(tokenizer, body)[1]


def chat_logprobs(
    tokenizer: Tokenizer, entries: list[LogprobEntry] | None, token_ids: list[int]
) -> ChatLogprobs | None:
    if entries is None:
        return None
    content = []
    for token_id, (logprob, top) in zip(token_ids, entries, strict=False):
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        alternatives = [
            TopLogprob(
                token=(text := tokenizer.decode([tid], skip_special_tokens=False)),
                logprob=lp,
                bytes=list(text.encode()),
            )
            for tid, lp in top
        ]
        content.append(
            ChatTokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=alternatives)
        )
    return ChatLogprobs(content=content)


async def create_chat_completion(state: ServerState, request: Request) -> Response | Stream:
    arrival = time.perf_counter()
    body = decode_body(await read_body(request, state.config.request_body_timeout_s), ChatCompletionRequest)
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
        turn = ChatTurn(state, body, setup, template_messages(body.messages))
        release.add_tokens(len(turn.prompt_ids) * max(body.n, 1))
    except BaseException:
        release()
        raise
    request_id = new_id("chatcmpl")
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = run_choices(state.client, request_id, [turn.prompt_ids], turn.params, state.metrics, arrival)
        if turn.params.structured_outputs is not None:  # an invalid grammar is a 400, not an SSE error
            events = await first_event_or_error(events, release, grammar_errors(turn.grammar_field))
        chunks = _chunks(state, request_id, turn, arrival, include_usage, events)
        body = sse_stream(chunks, finalize=release)
        return Stream(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=release_after(release, body, chunks, events),
        )
    try:
        return Response(
            await until_disconnect(
                request, _response(state, request_id, turn, arrival), grammar_errors(turn.grammar_field)
            )
        )
    finally:
        release()


class ChatTurn:
    """One generation of a chat request: the prompt, its sampling params, a parser per choice."""

    def __init__(
        self, state: ServerState, body: ChatCompletionRequest, setup: ToolSetup, messages: list[dict[str, Any]]
    ) -> None:
        self.body, self.setup, self.state = body, setup, state
        self.messages = messages  # the conversation as the template takes it (template_messages ran once)
        client = state.client
        self.served = state.served_parsers()
        # what the template drops of tools, calls and results, written in the generic format
        shown = with_generic_tools(messages, setup.tools, self.served.template_tools)
        self.prompt_text, self.prompt_ids = chat_prompt(client.tokenizer, body, setup.tools, shown)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = build_sampling_params(
            body,
            max_tokens=max_tokens,
            prompt_lens=[len(self.prompt_ids)],
            max_model_len=state.max_model_len,
            vocab_size=client.ready.vocab_size,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            defaults=state.config,
            default_max_tokens=state.config.max_gen_tokens,
        )
        self.parsers = [choice_parser(self.served, setup, self.prompt_text) for _ in range(max(params.n, 1))]
        tools = next((p.tools for p in self.parsers if p is not None and p.tools is not None), None)
        if tools is not None and tools.needs_special_tokens:
            params = params.replace(skip_special_tokens=False)
        reasoning = next((p.reasoning for p in self.parsers if p is not None and p.reasoning is not None), None)
        start_after = reasoning.end_marker if reasoning is not None and reasoning.starts_in_reasoning else None
        constraint = structured_outputs_for(setup, self.served)
        #: the request field the grammar came from, named in its errors
        self.grammar_field = structured_outputs_field(body)
        if constraint is not None and setup.mode == "auto" and params.structured_outputs is not None:
            constraint = None  # the client's response_format shapes the reply; calls are still parsed
        if constraint is not None:
            if params.structured_outputs is not None:
                raise bad_request(
                    f"tool_choice {setup.mode!r} constrains the reply itself; it cannot be combined with "
                    "response_format or structured_outputs",
                    "tool_choice",
                )
            params = params.replace(structured_outputs=constraint)
            # the constraint is built from the tools' parameter schemas: the request's, or the MCP servers'
            self.grammar_field = "tools" if body.tools is not None else "tools (from the MCP servers' tool schemas)"
        self.params = after_reasoning(params, start_after)

    def next_round(self, messages: list[dict[str, Any]]) -> ChatTurn:
        """The turn after the server ran MCP calls: after a forced call (required / named) the model
        answers freely, the tools still in view."""
        setup = self.setup if self.setup.mode == "auto" else ToolSetup(tools=self.setup.tools, mode="none")
        return ChatTurn(self.state, self.body, setup, messages)

    @property
    def calls_finish(self) -> bool:
        """Whether a reply with calls finishes with ``tool_calls`` (OpenAI: ``stop`` for a named tool_choice)."""
        return self.setup.mode in ("auto", "required")

    def message(self, index: int, choice: ChoiceState) -> tuple[ResponseMessage, str | None]:
        """The finished choice as a message, and its finish reason (``tool_calls`` when it called tools)."""
        parser = self.parsers[index]
        if parser is None:
            return ResponseMessage(content=choice.text), choice.finish_reason
        first, last = parser.feed(choice.text), parser.finish()
        reasoning = (first.reasoning + last.reasoning) or None
        calls = assemble(
            [ToolParseDelta(first.content, first.tool_calls), ToolParseDelta(last.content, last.tool_calls)]
        )
        tool_calls = [
            ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls.tool_calls
        ] or None
        finish = choice.finish_reason
        if tool_calls and finish == "stop" and self.calls_finish:
            finish = "tool_calls"
        return ResponseMessage(
            content=calls.content, tool_calls=tool_calls, reasoning_content=reasoning, reasoning=reasoning
        ), finish


class MCPRounds:
    """The rounds of one chat request, for the whole and the streamed response alike.

    Each round generates ``turn`` (:meth:`events`; the first round's events may have started
    already). With ``mcp_execute``, when a round's first choice ends with calls that are all MCP
    tools and rounds are left (:meth:`runs`), the server runs them (:meth:`run_calls`): the
    assistant turn and the tool results join the conversation and the next round answers it.

    Caps (``--mcp-max-*``): a round runs at most ``mcp_max_calls_per_round`` calls (the others get
    an error result), each result is cut to ``mcp_max_result_bytes``, and once the request has
    spent ``mcp_max_time_s`` in calls, the remaining calls get an error result and no round runs
    calls any more (the next calls go back to the client).
    """

    def __init__(
        self,
        state: ServerState,
        request_id: str,
        turn: ChatTurn,
        arrival: float,
        first_events: AsyncIterator[ChoiceDelta] | None = None,
    ) -> None:
        self.state, self.request_id, self.turn, self.arrival = state, request_id, turn, arrival
        self.first_events = first_events
        self.index = 0
        self.prompt_tokens = 0
        self.records: list[MCPCallRecord] = []  # every call the server ran, in order
        self.messages = list(turn.messages) if turn.body.mcp_execute else []
        self.tool_time_s = 0.0  # spent in MCP calls so far (--mcp-max-time bounds it)

    def events(self) -> AsyncIterator[ChoiceDelta]:
        """This round's deltas, every choice merged."""
        self.prompt_tokens += len(self.turn.prompt_ids)
        if self.index == 0 and self.first_events is not None:
            return self.first_events
        request_id = f"{self.request_id}-r{self.index}" if self.index else self.request_id
        return run_choices(
            self.state.client, request_id, [self.turn.prompt_ids], self.turn.params, self.state.metrics, self.arrival
        )

    def runs(self, calls: list[ToolCall]) -> bool:
        """Whether the server runs ``calls`` (the first choice's, at the end of this round) itself."""
        body = self.turn.body
        return bool(
            body.mcp_execute
            and calls
            and self.index < body.mcp_max_rounds
            and self.tool_time_s < self.state.config.mcp_max_time_s
            and all(self.state.mcp.can_execute(call.name) for call in calls)
        )

    async def run_calls(self, content: str, calls: list[ToolCall]) -> list[MCPCallRecord]:
        """Run MCP ``calls`` in order, add the assistant turn (``content`` and the calls) and the
        tool results to the conversation, and make the next round's turn; returns the records."""
        self.messages.append(
            {
                "role": "assistant",
                "content": content,
                "tool_calls": template_tool_calls(
                    [
                        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                        for c in calls
                    ]
                ),
            }
        )
        config = self.state.config
        records = []
        for number, call in enumerate(calls):
            left_s = config.mcp_max_time_s - self.tool_time_s
            if number >= config.mcp_max_calls_per_round:
                result, is_error = (
                    (
                        f"not run: more than {config.mcp_max_calls_per_round} tool calls in one round "
                        "(--mcp-max-calls-per-round)"
                    ),
                    True,
                )
            elif left_s <= 0:
                result, is_error = (
                    (f"not run: this request spent its {config.mcp_max_time_s:g} s of MCP tool time (--mcp-max-time)"),
                    True,
                )
            else:
                started = time.monotonic()
                result, is_error = await self.state.mcp.call_tool(
                    call.name, call.arguments, timeout_s=left_s, max_result_bytes=config.mcp_max_result_bytes
                )
                self.tool_time_s += time.monotonic() - started
            records.append(
                MCPCallRecord(id=call.id, name=call.name, arguments=call.arguments, result=result, is_error=is_error)
            )
            self.messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result})
        self.records += records
        self.turn = self.turn.next_round(self.messages)
        self.index += 1
        return records


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
        usage=Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details={"cached_tokens": num_cached} if num_cached else None,
        ),
    )


def _delta_message(parsed: ParsedDelta, sent_calls: set[int]) -> DeltaMessage | None:
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


async def _chunks(
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
                message = _delta_message(parsed, sent_calls[delta.index])
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
        yield chunk(
            [],
            Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
                prompt_tokens_details={"cached_tokens": num_cached} if num_cached else None,
            ),
        )
