"""``POST /v1/completions``: a string, strings, token ids or lists of token ids; ``echo``; logprobs."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

from litestar import Request, Response
from litestar.response import Stream

from framework.engine.outputs import LogprobEntry
from framework.server.chat_prompt import reject_unsupported
from framework.server.errors import APIError, bad_request, decode_body
from framework.server.generation import ChoiceDelta, ChoiceState, build_sampling_params, run_choices
from framework.server.limits import check_count, check_sampling_limits, check_token_ids, read_body
from framework.server.protocol import (
    UNSUPPORTED_COMPLETION_FIELDS,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from framework.server.state import ServerState, new_id, release_after, sse_stream, until_disconnect
from framework.server.structured_outputs import first_event_or_error, grammar_errors, structured_outputs_field
from framework.tokenizer import Tokenizer


def prompt_token_lists(
    tokenizer: Tokenizer, prompt: object, vocab_size: int, max_items: int, flag: str = "--max-prompts"
) -> tuple[list[list[int]], list[str]]:
    """Every prompt as token ids, plus its text (for ``echo``): at most ``max_items`` of them,
    token ids given by the client checked against ``vocab_size`` before anything decodes them.

    Text is tokenized with special-token parsing on: a raw prompt is the client's own text, so
    ``<|im_end|>`` written in it is that control token (as in vLLM and llama.cpp).
    """

    def is_ids(value: object) -> bool:
        return (
            isinstance(value, list)
            and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
        )

    if isinstance(prompt, str):
        items: list = [prompt]
    elif is_ids(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        items = prompt
    else:
        raise APIError(
            400,
            "'prompt' must be a non-empty string, a list of strings, a list of token ids, or a list of "
            "lists of token ids",
            param="prompt",
            code="invalid_type",
        )
    check_count(len(items), "prompt", max_items, flag)
    ids, texts = [], []
    for item in items:
        if isinstance(item, str):
            ids.append(tokenizer.encode(item))
            texts.append(item)
        else:
            check_token_ids(item, vocab_size, "prompt")
            ids.append(list(item))
            texts.append(tokenizer.decode(item, skip_special_tokens=False))
        if not ids[-1]:
            raise bad_request("the prompt is empty: give at least one token", "prompt")
    return ids, texts


class _LogprobBuilder:
    """Accumulates OpenAI's completions logprobs layout (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, tokenizer: Tokenizer, offset: int = 0) -> None:
        self.tokenizer, self.offset = tokenizer, offset
        self.result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])

    def add(self, token_ids: list[int], entries: list[LogprobEntry | None]) -> CompletionLogprobs:
        decode = self.tokenizer.decode
        for token_id, entry in zip(token_ids, entries, strict=False):
            token = decode([token_id], skip_special_tokens=False)
            self.result.tokens.append(token)
            self.result.text_offset.append(self.offset)
            self.offset += len(token)
            if entry is None:
                self.result.token_logprobs.append(None)
                self.result.top_logprobs.append(None)
            else:
                self.result.token_logprobs.append(entry[0])
                self.result.top_logprobs.append({decode([tid], skip_special_tokens=False): lp for tid, lp in entry[1]})
        return self.result


async def create_completion(state: ServerState, request: Request) -> Response | Stream:
    arrival = time.perf_counter()
    body = decode_body(await read_body(request, state.config.request_body_timeout_s), CompletionRequest)
    state.check_model(body.model)
    reject_unsupported(body, UNSUPPORTED_COMPLETION_FIELDS)
    check_sampling_limits(body, state.config.max_n)
    client = state.client
    num_prompts = (
        len(body.prompt) if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int) else 1
    )
    check_count(num_prompts, "prompt", state.config.max_prompts, "--max-prompts")
    # max_tokens 0 (accepted with echo) scores the prompt: one token is generated (prompt logprobs
    # come with the first step) and dropped, as if none was
    scores_only = body.max_tokens == 0
    release = state.admit(body.n * num_prompts)
    try:
        prompts, texts = prompt_token_lists(
            client.tokenizer, body.prompt, client.ready.vocab_size, state.config.max_prompts
        )
        release.add_tokens(sum(len(p) for p in prompts) * body.n)
        params = build_sampling_params(
            body,
            max_tokens=1 if scores_only else body.max_tokens,
            prompt_lens=[len(p) for p in prompts],
            max_model_len=state.max_model_len,
            vocab_size=client.ready.vocab_size,
            logprobs=body.logprobs,
            prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
            defaults=state.config,
            model_defaults=state.sampling_defaults,
            default_max_tokens=state.config.max_gen_tokens or 16,
        )  # OpenAI's default: 16
    except BaseException:
        release()
        raise
    request_id = new_id("cmpl")
    events = run_choices(client, request_id, prompts, params, state.metrics, arrival)
    job = _Completion(state, request_id, body, prompts, texts, params.n, scores_only)
    to_api_error = grammar_errors(structured_outputs_field(body))
    if body.stream and params.structured_outputs is not None:  # an invalid grammar is a 400, not an SSE error
        events = await first_event_or_error(events, release, to_api_error)
    if body.stream:
        chunks = job.chunks(events)
        body = sse_stream(chunks, finalize=release)
        return Stream(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=release_after(release, body, chunks, events),
        )
    try:
        return Response(await until_disconnect(request, job.response(events), to_api_error))
    finally:
        release()


class _Completion:
    def __init__(
        self,
        state: ServerState,
        request_id: str,
        body: CompletionRequest,
        prompts: list[list[int]],
        texts: list[str],
        n: int,
        scores_only: bool = False,
    ) -> None:
        self.state, self.request_id, self.body, self.prompts, self.texts, self.n = (
            state,
            request_id,
            body,
            prompts,
            texts,
            n,
        )
        self.scores_only = scores_only  # max_tokens 0: the generated token is dropped
        self.tokenizer = state.client.tokenizer
        self.created = int(time.time())

    def _usage(self, completion_tokens: int, num_cached: int) -> Usage:
        return Usage.counted(sum(len(p) for p in self.prompts) * self.n, completion_tokens, num_cached)

    def _scored(self, delta: ChoiceDelta) -> ChoiceDelta:
        """``delta`` without its generated text and tokens when the request only scores its prompt."""
        if not self.scores_only:
            return delta
        return dataclasses.replace(
            delta,
            text="",
            token_ids=[],
            logprobs=[] if delta.logprobs is not None else None,
            finish_reason="length" if delta.finish_reason is not None else None,
            stop_reason=None,
        )

    def _echo_logprobs(self, builder: _LogprobBuilder, prompt_index: int, prompt_logprobs) -> None:
        if self.body.echo and prompt_logprobs is not None:
            builder.add(self.prompts[prompt_index], prompt_logprobs)

    async def response(self, events: AsyncIterator[ChoiceDelta]) -> CompletionResponse:
        choices = [ChoiceState() for _ in range(len(self.prompts) * self.n)]
        num_cached = 0
        async for delta in events:
            choices[delta.index].add(self._scored(delta))
            num_cached = max(num_cached, delta.num_cached_tokens)
        result = []
        for index, choice in enumerate(choices):
            prompt_index = index // self.n
            prefix = self.texts[prompt_index] if self.body.echo else ""
            logprobs = None
            if self.body.logprobs is not None:
                builder = _LogprobBuilder(self.tokenizer)
                self._echo_logprobs(builder, prompt_index, choice.prompt_logprobs)
                logprobs = builder.add(choice.token_ids, choice.logprobs)
            result.append(
                CompletionChoice(
                    index=index,
                    text=prefix + choice.text,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        return CompletionResponse(
            id=self.request_id,
            model=self.state.model_name,
            created=self.created,
            choices=result,
            usage=self._usage(sum(len(c.token_ids) for c in choices), num_cached),
        )

    async def chunks(self, events: AsyncIterator[ChoiceDelta]) -> AsyncIterator[CompletionResponse]:
        started: set[int] = set()
        builders: dict[int, _LogprobBuilder] = {}
        completion_tokens = num_cached = 0
        async for delta in events:
            delta = self._scored(delta)
            completion_tokens += len(delta.token_ids)
            num_cached = max(num_cached, delta.num_cached_tokens)
            text = delta.text
            logprobs = None
            if self.body.logprobs is not None:
                builder = _LogprobBuilder(
                    self.tokenizer, builders[delta.index].offset if delta.index in builders else 0
                )
                if delta.index not in started:
                    self._echo_logprobs(builder, delta.prompt_index, delta.prompt_logprobs)
                logprobs = builder.add(delta.token_ids, delta.logprobs or [])
                builders[delta.index] = builder
            if delta.index not in started:
                started.add(delta.index)
                if self.body.echo:
                    text = self.texts[delta.prompt_index] + text
            if not text and delta.finish_reason is None and logprobs is None:
                continue
            yield CompletionResponse(
                id=self.request_id,
                model=self.state.model_name,
                created=self.created,
                choices=[
                    CompletionChoice(
                        index=delta.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=delta.finish_reason,
                        stop_reason=delta.stop_reason,
                    )
                ],
            )
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            yield CompletionResponse(
                id=self.request_id,
                model=self.state.model_name,
                created=self.created,
                choices=[],
                usage=self._usage(completion_tokens, num_cached),
            )
