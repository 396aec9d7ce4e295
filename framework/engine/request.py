"""The state of one request inside the engine: plain data with derived properties."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from framework.sampling_params import SamplingParams

if TYPE_CHECKING:
    from framework.engine.multimodal_step import RequestImage
    from framework.engine.structured_outputs import StructuredOutputState


#: In ``Request.output_token_ids``: a token sampled on the device by a step still in flight (async
#: scheduling); the engine writes the real id there when it reads the step's results back.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request ended; the values are OpenAI's ``finish_reason`` strings."""

    STOP = "stop"  # EOS, a stop token id, or a stop string (the API process aborts with STOP)
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # the client went away or the user aborted


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated. ``num_computed_tokens`` catches up to ``num_tokens``.

    The scheduler gives each running request ``num_tokens - num_computed_tokens`` more tokens
    per step (chunked by the budget); when they meet, the model's output at the last position
    is sampled and appended. Preemption frees the blocks and sets ``num_computed_tokens`` to 0:
    the request is recomputed later, usually from the prefix cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    #: KV blocks in sequence order: grows by appends while the request runs, and is replaced by a
    #: new list (never cleared in place) when the blocks are freed (see BlockTableSync)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_keyed_blocks: int = 0  # leading blocks the prefix cache has already considered (cache_full_blocks)
    num_cached_tokens: int = -1  # prefix-cache hit of the first schedule; -1 = not yet looked up
    num_preemptions: int = 0
    state_slot: int = -1  # hybrid models: the state-cache slot it holds while running (-1: none)
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    generator: torch.Generator | None = None
    prompt_logprobs: list = field(default_factory=list)
    pooling: str | None = None  # "mean" or "last": an embedding request (no tokens are generated)
    pooled: torch.Tensor | None = None  # running sum (mean) or last hidden state over the prompt
    structured_output: StructuredOutputState | None = None  # the grammar state, if structured_outputs is set
    #: the prompt's images (in order) and their encoder outputs by index, kept until the request
    #: finishes (:mod:`framework.engine.multimodal_step`)
    images: list[RequestImage] = field(default_factory=list)
    image_embeds: dict[int, torch.Tensor] = field(default_factory=dict)
    rope_positions: torch.Tensor | None = None  # M-RoPE: [3, num_prompt_tokens] for a prompt with images
    rope_delta: int = 0  # M-RoPE: a token past the prompt at index i has position i + rope_delta
    #: fixed at creation (read several times per step for every running request)
    num_prompt_tokens: int = field(init=False)
    #: the most output tokens this request may produce (its max_tokens and the context length)
    max_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        room = self.max_model_len - self.num_prompt_tokens
        asked = self.sampling_params.max_tokens
        self.max_tokens = room if asked is None else min(asked, room)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    def token_ids_at(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output, without building the whole list (a decode step reads one id)."""
        prompt = self.num_prompt_tokens
        if start >= prompt:
            return self.output_token_ids[start - prompt : end - prompt]
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt]

    def check_stop(self, index: int) -> FinishReason | None:
        """After output token ``index`` was set: the reason to finish there, or None.

        Only the tokens up to ``index`` count; later entries are placeholders of a step in flight.
        """
        params = self.sampling_params
        last, count = self.output_token_ids[index], index + 1
        if count >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_token_id = last
                return FinishReason.STOP
            if last in params.stop_token_ids:
                self.stop_token_id = last
                return FinishReason.STOP
        if count >= self.max_tokens:
            return FinishReason.LENGTH
        return None
