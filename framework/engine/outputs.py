"""What the engine reports: per-request outputs and counters (msgspec, no torch import).

These cross the process boundary when serving, so the API process imports this module without
importing torch.
"""

from __future__ import annotations

import msgspec

#: One token's logprob entry: (logprob, [(token id, logprob), ...] top alternatives).
LogprobEntry = tuple[float, list[tuple[int, float]]]


class RequestOutput(msgspec.Struct, kw_only=True):
    """What one step produced for one request (crosses the process boundary when serving)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None  # sent once, with the first token
    finish_reason: str | None = None
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    embedding: list[float] | None = None  # pooling requests: the normalized pooled hidden state
    #: Why the engine gave the request up (with finish_reason "abort"): the caller reports it as the
    #: request's error. None for every other output.
    error: str | None = None
    #: What kind of failure ``error`` is: :data:`GRAMMAR_FAILED` (its grammar failed to compile: the
    #: request was bad), :data:`OUT_OF_MEMORY` or :data:`STEP_FAILED` (a step it was in raised: the
    #: request was fine and may be retried).
    error_kind: str | None = None


GRAMMAR_FAILED = "grammar"
OUT_OF_MEMORY = "out_of_memory"
STEP_FAILED = "step_failed"


class EngineStats(msgspec.Struct, kw_only=True):
    """Counters for ``/metrics`` and tests."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_failed_steps: int = 0  # steps that raised; their requests finished with an error
