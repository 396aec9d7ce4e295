"""Messages between the API process and the engine process (msgpack over ZMQ ``ipc://`` sockets).

Two one-way PUSH/PULL channels::

    API process  ──(EngineRequest: AddRequest | AbortRequests | GetStats | Shutdown)──▶  engine process
    API process  ◀──(EngineReply: Ready | LoadFailed | StepOutputs | AddFailed | StatsReply | EngineFailed | Heartbeat)──

Outputs are batched: one :class:`StepOutputs` per engine step carries every request's new tokens.
"""

from __future__ import annotations

from typing import Any

import msgspec

from framework.engine.outputs import EngineStats, RequestOutput
from framework.multimodal.inputs import ImageInput, VisionSpec
from framework.sampling_params import SamplingParams


# --- API process -> engine process -------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    pooling: str | None = None  # an embedding request
    images: list[ImageInput] = []  # the prompt's preprocessed images (a vision model)


class AbortRequests(msgspec.Struct, tag="abort", kw_only=True):
    request_ids: list[str]


class GetStats(msgspec.Struct, tag="get_stats", kw_only=True):
    query_id: int


class Shutdown(msgspec.Struct, tag="shutdown", kw_only=True):
    pass


EngineRequest = AddRequest | AbortRequests | GetStats | Shutdown


# --- engine process -> API process -------------------------------------------------------
class TokenizerSpec(msgspec.Struct, kw_only=True):
    """Everything the API process needs to rebuild the engine's :class:`~framework.tokenizer.Tokenizer`."""

    tokenizer_json: str
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    extra_eos_token_ids: list[int] = []
    template_vars: dict[str, Any] = {}


class Ready(msgspec.Struct, tag="ready", kw_only=True):
    summary: dict[str, Any]
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    tokenizer: TokenizerSpec
    #: the model's sampling defaults (``generation_config.json``), for requests that leave them unset
    sampling_defaults: dict[str, float] = {}
    #: how the model takes images (None: text only)
    vision: VisionSpec | None = None


class LoadFailed(msgspec.Struct, tag="load_failed", kw_only=True):
    message: str


class StepOutputs(msgspec.Struct, tag="outputs", kw_only=True):
    outputs: list[RequestOutput]


class AddFailed(msgspec.Struct, tag="add_failed", kw_only=True):
    request_id: str
    message: str
    #: the refusal was a GrammarError (the request's structured-output constraint)
    grammar: bool = False
    #: the request was valid but the engine failed to queue it (a RequestFailedError)
    internal: bool = False


class StatsReply(msgspec.Struct, tag="stats", kw_only=True):
    query_id: int
    stats: EngineStats


class EngineFailed(msgspec.Struct, tag="engine_failed", kw_only=True):
    message: str


class Heartbeat(msgspec.Struct, tag="heartbeat", kw_only=True):
    """Sent by an engine loop that has sent nothing else for a while: the loop is alive."""


EngineReply = Ready | LoadFailed | StepOutputs | AddFailed | StatsReply | EngineFailed | Heartbeat
