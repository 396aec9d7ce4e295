"""``POST /v1/chat/completions``: messages -> chat template -> tokens -> choices, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response
from litestar.response import Stream

from framework.engine.outputs import LogprobEntry
from framework.errors import ConfigError
from framework.server.errors import APIError, bad_request, decode_body
from framework.server.generation import ChoiceDelta, ChoiceState, build_sampling_params, run_choices
from framework.server.protocol import (
    UNSUPPORTED_CHAT_FIELDS,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    ResponseMessage,
    TopLogprob,
    Usage,
)
from framework.server.state import ServerState, engine_error, new_id, release_after, sse_stream, until_disconnect
from framework.server.structured_outputs import first_event_or_error
from framework.tokenizer import Tokenizer


def reject_unsupported(body: Any, names: tuple[str, ...]) -> None:
    """A field fw does not support yet is a 400 naming it, never silently ignored."""
    for name in names:
        if getattr(body, name) is not None:
            raise APIError(400, f"{name!r} is not supported by this server yet", param=name, code="unsupported_parameter")
    if getattr(body, "best_of", None) not in (None, 1, getattr(body, "n", 1)):
        raise APIError(400, "'best_of' is not supported by this server yet", param="best_of",
                       code="unsupported_parameter")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them; content parts are joined text."""
    if not messages:
        raise bad_request("'messages' must hold at least one message", "messages")
    result = []
    for i, message in enumerate(messages):
        if message.role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role must be one of system, developer, user, assistant, tool; "
                              f"got {message.role!r}", f"messages[{i}].role")
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"content part type {part.get('type')!r} is not supported (only 'text')",
                                   param=f"messages[{i}].content[{j}].type", code="unsupported_parameter")
                texts.append(part["text"])
            content = "\n".join(texts)
        item: dict[str, Any] = {"role": message.role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            if getattr(message, key) is not None:
                item[key] = getattr(message, key)
        result.append(item)
    return result


def chat_prompt_ids(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[int]:
    messages = template_messages(body.messages)
    kwargs = dict(body.chat_template_kwargs or {})
    add_generation_prompt = kwargs.pop("add_generation_prompt", body.add_generation_prompt)
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    except ConfigError as error:
        raise bad_request(str(error), "messages") from None
    except Exception as error:  # jinja2 errors from the model's own template
        raise bad_request(f"the chat template failed on these messages: {error}", "messages") from None


def chat_logprobs(tokenizer: Tokenizer, entries: list[LogprobEntry] | None, token_ids: list[int]) -> ChatLogprobs | None:
    if entries is None:
        return None
    content = []
    for token_id, (logprob, top) in zip(token_ids, entries, strict=False):
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        alternatives = [TopLogprob(token=(text := tokenizer.decode([tid], skip_special_tokens=False)), logprob=lp,
                                   bytes=list(text.encode())) for tid, lp in top]
        content.append(ChatTokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


async def create_chat_completion(state: ServerState, request: Request) -> Response | Stream:
    arrival = time.perf_counter()
    body = decode_body(await request.body(), ChatCompletionRequest)
    state.check_model(body.model)
    reject_unsupported(body, UNSUPPORTED_CHAT_FIELDS)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    release = state.admit(max(body.n, 1))
    try:
        client = state.client
        prompt_ids = chat_prompt_ids(client.tokenizer, body)
        release.add_tokens(len(prompt_ids) * max(body.n, 1))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = build_sampling_params(body, max_tokens=max_tokens, prompt_lens=[len(prompt_ids)],
                                       max_model_len=state.max_model_len, vocab_size=client.ready.vocab_size,
                                       logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                                       defaults=state.config, default_max_tokens=state.config.max_gen_tokens)
    except BaseException:
        release()
        raise
    request_id = new_id("chatcmpl")
    events = run_choices(client, request_id, [prompt_ids], params, state.metrics, arrival)
    if body.stream and params.structured_outputs is not None:  # an invalid grammar is a 400, not an SSE error
        events = await first_event_or_error(events, release, engine_error)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = _chunks(state, request_id, events, params.n, len(prompt_ids), include_usage)
        body = sse_stream(chunks, finalize=release)
        return Stream(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                      background=release_after(release, body, chunks, events))
    try:
        return Response(await until_disconnect(request, _response(state, request_id, events, params.n, len(prompt_ids))))
    finally:
        release()


async def _response(state: ServerState, request_id: str, events: AsyncIterator[ChoiceDelta], n: int,
                    num_prompt_tokens: int) -> ChatCompletionResponse:
    choices = [ChoiceState() for _ in range(n)]
    num_cached = 0
    wants_logprobs = None
    async for delta in events:
        choices[delta.index].add(delta)
        num_cached = max(num_cached, delta.num_cached_tokens)
        wants_logprobs = wants_logprobs or delta.logprobs is not None
    tokenizer = state.client.tokenizer
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return ChatCompletionResponse(
        id=request_id, model=state.model_name,
        choices=[ChatChoice(index=i, message=ResponseMessage(content=c.text),
                            logprobs=chat_logprobs(tokenizer, c.logprobs if wants_logprobs else None, c.token_ids),
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason) for i, c in enumerate(choices)],
        usage=Usage(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=num_prompt_tokens + completion_tokens,
                    prompt_tokens_details={"cached_tokens": num_cached} if num_cached else None))


async def _chunks(state: ServerState, request_id: str, events: AsyncIterator[ChoiceDelta], n: int, num_prompt_tokens: int,
                  include_usage: bool) -> AsyncIterator[ChatCompletionChunk]:
    created = int(time.time())
    model = state.model_name
    tokenizer = state.client.tokenizer

    def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, model=model, created=created, choices=choices, usage=usage)

    for i in range(n):
        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
    completion_tokens = num_cached = 0
    async for delta in events:
        completion_tokens += len(delta.token_ids)
        num_cached = max(num_cached, delta.num_cached_tokens)
        if not delta.text and delta.finish_reason is None and delta.logprobs is None:
            continue
        yield chunk([ChatStreamChoice(index=delta.index, delta=DeltaMessage(content=delta.text),
                                      logprobs=chat_logprobs(tokenizer, delta.logprobs, delta.token_ids),
                                      finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)])
    if include_usage:
        yield chunk([], Usage(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                              total_tokens=num_prompt_tokens + completion_tokens,
                              prompt_tokens_details={"cached_tokens": num_cached} if num_cached else None))
