"""One chat generation and its MCP rounds: :class:`ChatTurn` (prompt, sampling params, parsers)
and :class:`MCPRounds` (the server running MCP tool calls between rounds)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from framework.multimodal.inputs import ImageInput, ProcessedImage
from framework.multimodal.prompt import first_image_part
from framework.parsers.base import ToolCall, ToolParseDelta, assemble
from framework.server.chat_images import chat_prompt_with_images
from framework.server.chat_prompt import chat_prompt
from framework.server.chat_tools import (
    ToolSetup,
    after_reasoning,
    choice_parser,
    structured_outputs_for,
    template_tool_calls,
)
from framework.server.errors import bad_request
from framework.server.generation import ChoiceDelta, ChoiceState, build_sampling_params, run_choices
from framework.server.protocol import (
    ChatCompletionRequest,
    FunctionCall,
    MCPCallRecord,
    ResponseMessage,
    ToolCallOut,
)
from framework.server.state import ServerState
from framework.server.structured_outputs import structured_outputs_field
from framework.server.template_tools import with_generic_tools


class ChatTurn:
    """One generation of a chat request: the prompt, its sampling params, a parser per choice."""

    def __init__(
        self,
        state: ServerState,
        body: ChatCompletionRequest,
        setup: ToolSetup,
        messages: list[dict[str, Any]],
        processed_images: list[ProcessedImage] | None = None,
    ) -> None:
        """``processed_images``: the conversation's images, already preprocessed (off the event
        loop); a vision model's turn without them preprocesses them here."""
        self.body, self.setup, self.state = body, setup, state
        self.messages = messages  # the conversation as the template takes it (template_messages ran once)
        client = state.client
        self.served = state.served_parsers()
        # what the template drops of tools, calls and results, written in the generic format
        shown = with_generic_tools(messages, setup.tools, self.served.template_tools)
        #: the prompt's images (a vision model), placed in ``prompt_ids``, and as preprocessed
        self.images: list[ImageInput] = []
        self.processed_images = processed_images
        if state.vision is not None and first_image_part(shown) is not None:
            self.prompt_text, self.prompt_ids, self.images, self.processed_images = chat_prompt_with_images(
                state, body, setup.tools, shown, processed_images
            )
        else:
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
            model_defaults=state.sampling_defaults,
        )
        self.parsers = [choice_parser(self.served, setup, self.prompt_text) for _ in range(max(params.n, 1))]
        tools = next((p.tools for p in self.parsers if p is not None and p.tools is not None), None)
        reasoning = next((p.reasoning for p in self.parsers if p is not None and p.reasoning is not None), None)
        if any(parser is not None and parser.needs_special_tokens for parser in (tools, reasoning)):
            params = params.replace(skip_special_tokens=False)
        start_after = reasoning.end_marker if reasoning is not None and reasoning.starts_in_reasoning else None
        constraint = structured_outputs_for(setup)
        #: the request field the grammar came from, named in its errors
        self.grammar_field = structured_outputs_field(body)
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
        return ChatTurn(self.state, self.body, setup, messages, self.processed_images)

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
            self.state.client,
            request_id,
            [self.turn.prompt_ids],
            self.turn.params,
            self.state.metrics,
            self.arrival,
            images=self.turn.images,
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
