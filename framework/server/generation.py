"""Shared by the chat and completions handlers: request -> SamplingParams, fan-out, text per choice.

``run_choices`` fans a request out into one engine request per (prompt, n) pair (ids
``{request_id}-{index}``, seed + i as in :meth:`framework.llm.LLM.generate`), detokenizes each with
:class:`~framework.output_text.SequenceText`, applies stop strings (aborting the engine request
when one matches), and yields one :class:`ChoiceDelta` per engine output, merged across choices.
Leaving the iteration early aborts every unfinished engine request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from framework.engine.outputs import LogprobEntry
from framework.errors import GrammarError, RequestFailedError
from framework.multimodal.inputs import ImageInput
from framework.output_text import SequenceText
from framework.sampling_params import SamplingParams
from framework.server.engine_client import AsyncEngineClient
from framework.server.errors import APIError, bad_request
from framework.server.metrics import ServerMetrics
from framework.server.state import ServerConfig
from framework.server.structured_outputs import structured_outputs_from_request


@dataclass(slots=True)
class ChoiceDelta:
    """What one engine output added to one choice."""

    index: int
    prompt_index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobEntry] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class ChoiceState:
    """Accumulated state of one choice (non-streaming responses and usage)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def build_sampling_params(
    body: Any,
    *,
    max_tokens: int | None,
    prompt_lens: list[int],
    max_model_len: int,
    vocab_size: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    defaults: ServerConfig | None = None,
    default_max_tokens: int | None = None,
    model_defaults: dict[str, float] | None = None,
) -> SamplingParams:
    """Validate the sampling fields of a request; errors are 400s naming the field.

    Fields the request leaves unset take the server's defaults (``default_max_tokens``,
    ``--presence-penalty``, ``--frequency-penalty``), and ``temperature``, ``top_p``, ``top_k``,
    ``min_p`` and ``repetition_penalty`` the model's (``model_defaults``, from its
    ``generation_config.json``: :func:`sampling_defaults`); a default ``max_tokens`` never exceeds
    the room left in the context.
    """
    defaults = defaults or ServerConfig()
    model = model_defaults or {}
    longest = max(prompt_lens)
    if longest >= max_model_len or (max_tokens is not None and longest + max_tokens > max_model_len):
        requested = max_tokens if max_tokens is not None else 0
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{longest + requested} tokens ({longest} in the prompt, {requested} for the completion). "
            "Please reduce the prompt or the completion length.",
            param="messages" if hasattr(body, "messages") else "prompt",
            code="context_length_exceeded",
        )
    logit_bias = None
    if body.logit_bias:
        logit_bias = {}
        for key, value in body.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not 0 <= token_id < vocab_size:
                raise bad_request(
                    f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})", "logit_bias"
                )
            logit_bias[token_id] = value
    for token_id in body.stop_token_ids or []:
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"stop_token_ids: {token_id} is outside the vocabulary [0, {vocab_size})", "stop_token_ids"
            )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    fields = {
        "n": body.n,
        "temperature": _default(body.temperature, model.get("temperature", 1.0)),
        "top_p": _default(body.top_p, model.get("top_p", 1.0)),
        "top_k": _default(body.top_k, model.get("top_k", 0)),
        "min_p": _default(body.min_p, model.get("min_p", 0.0)),
        "presence_penalty": _default(body.presence_penalty, defaults.presence_penalty),
        "frequency_penalty": _default(body.frequency_penalty, defaults.frequency_penalty),
        "repetition_penalty": _default(body.repetition_penalty, model.get("repetition_penalty", 1.0)),
        "logit_bias": logit_bias,
        "seed": body.seed,
        "max_tokens": max_tokens
        if max_tokens is not None
        else min(max_model_len - longest, default_max_tokens or max_model_len),
        "min_tokens": body.min_tokens,
        "stop": stop,
        "stop_token_ids": list(body.stop_token_ids or []),
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "ignore_eos": body.ignore_eos,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "skip_special_tokens": body.skip_special_tokens,
        "structured_outputs": structured_outputs_from_request(body),
    }
    try:
        return SamplingParams(**fields)
    except ValueError as error:
        message = str(error)
        param = message.split()[0]
        param = {"stop": "stop", "logprobs": "top_logprobs" if hasattr(body, "messages") else "logprobs"}.get(
            param, param
        )
        raise bad_request(message, param if param in fields or param == "top_logprobs" else None) from None


def _default(value: float | None, default: float) -> float:
    return default if value is None else value


async def run_choices(
    client: AsyncEngineClient,
    request_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    metrics: ServerMetrics | None = None,
    arrival: float | None = None,
    images: list[ImageInput] | None = None,
) -> AsyncIterator[ChoiceDelta]:
    """Yield every choice's deltas as they come; see the module docstring. ``images``: those of the
    (one) prompt, for a vision model."""
    arrival = arrival or time.perf_counter()
    queue: asyncio.Queue = asyncio.Queue()
    child_ids: list[str] = []
    tasks = []
    for prompt_index, prompt_ids in enumerate(prompts):
        for i in range(params.n):
            index = prompt_index * params.n + i
            child = params.replace(n=1, seed=None if params.seed is None else params.seed + i)
            child_id = f"{request_id}-{index}"
            child_ids.append(child_id)
            tasks.append(
                asyncio.create_task(
                    _pump(client, child_id, index, prompt_index, prompt_ids, child, queue, metrics, arrival, images)
                )
            )
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finish_reason is not None:
                remaining -= 1
            yield item
    finally:
        for task in tasks:
            task.cancel()
        client.abort(*child_ids)
        if metrics is not None:
            metrics.e2e.observe(time.perf_counter() - arrival)


async def _pump(
    client: AsyncEngineClient,
    child_id: str,
    index: int,
    prompt_index: int,
    prompt_ids: list[int],
    params: SamplingParams,
    queue: asyncio.Queue,
    metrics: ServerMetrics | None,
    arrival: float,
    images: list[ImageInput] | None = None,
) -> None:
    text = SequenceText(client.tokenizer, params)
    last = None
    try:
        extra = {"images": images} if images else {}  # text requests: the plain call every client takes
        async for output in client.generate(child_id, prompt_ids, params, **extra):
            now = time.perf_counter()
            if metrics is not None:
                if last is None:
                    metrics.ttft.observe(now - arrival)
                else:
                    metrics.itl.observe(now - last)
            last = now
            new_ids = output.new_token_ids
            if (
                not params.skip_special_tokens
                and output.stop_token_id is not None
                and new_ids
                and new_ids[-1] == output.stop_token_id
            ):
                new_ids = new_ids[:-1]  # the stop token (EOS) is not text, even when special tokens are kept
            stopped = text.add(new_ids)
            finish, stop_reason = output.finish_reason, output.stop_token_id
            if stopped:
                finish, stop_reason = "stop", text.stop_string
            elif finish is not None and stop_reason not in params.stop_token_ids:
                stop_reason = None  # EOS is not reported as a stop reason (as in vLLM)
            if finish is not None and metrics is not None:
                metrics.finished(finish)
            queue.put_nowait(
                ChoiceDelta(
                    index,
                    prompt_index,
                    text.delta(finished=finish is not None),
                    list(output.new_token_ids),
                    output.new_logprobs,
                    finish,
                    stop_reason,
                    output.prompt_logprobs,
                    output.num_cached_tokens,
                )
            )
            if stopped:
                return  # leaving generate() aborts the engine request
    except Exception as error:
        if metrics is not None and isinstance(error, GrammarError | RequestFailedError):
            metrics.finished("abort")  # the engine finished it as aborted (a bad grammar, or a failed step)
        queue.put_nowait(error)
