"""Bounds a request must keep before it reaches the engine; each breach is a 4xx naming the field.

The per-server caps (``--max-n``, ``--max-prompts``, ``--max-embedding-inputs``,
``--request-body-timeout``) live in :class:`~framework.server.state.ServerConfig`; the fixed ones
are here. Every integer the engine receives is range-checked first, because the engine process
gets requests as msgpack (64-bit integers) and must never see a value it cannot encode.
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Request

from framework.server.errors import APIError, bad_request

#: At most this many stop strings, of at most this many characters (each is matched per token).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
#: The longest JSON Schema text, regular expression, grammar or choice list of structured outputs.
MAX_GRAMMAR_CHARS = 64 * 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: The largest ``top_k`` accepted (larger ones keep the whole vocabulary anyway).
MAX_TOP_K = 2**31 - 1


async def read_body(request: Request, timeout_s: float | None) -> bytes:
    """The request body, or 408 when the client takes longer than ``timeout_s`` to send it."""
    if timeout_s is None:
        return await request.body()
    try:
        return await asyncio.wait_for(request.body(), timeout_s)
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout_s:g} s (--request-body-timeout)",
            code="request_timeout",
        ) from None


def check_range(value: int | None, name: str, low: int, high: int) -> None:
    if value is not None and not low <= value <= high:
        raise bad_request(f"{name!r} must be in [{low}, {high}], got {value}", name)


def check_sampling_limits(body: Any, max_n: int) -> None:
    """``n``, ``seed``, ``top_k``, token counts and stop strings of a chat or completions request."""
    check_range(body.n, "n", 1, max_n)
    check_range(body.seed, "seed", INT64_MIN, INT64_MAX)
    check_range(body.top_k, "top_k", -1, MAX_TOP_K)
    check_range(body.min_tokens, "min_tokens", 0, INT64_MAX)
    for name in ("max_tokens", "max_completion_tokens"):
        check_range(getattr(body, name, None), name, 1, INT64_MAX)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are accepted", "stop")
    for text in stop:
        if len(text) > MAX_STOP_CHARS:
            raise bad_request(
                f"a stop string has {len(text)} characters; at most {MAX_STOP_CHARS} are accepted", "stop"
            )
    if body.stop_token_ids is not None and len(body.stop_token_ids) > MAX_STOP_STRINGS:
        raise bad_request(
            f"'stop_token_ids' holds {len(body.stop_token_ids)} ids; at most {MAX_STOP_STRINGS} are accepted",
            "stop_token_ids",
        )


def check_count(count: int, name: str, cap: int, flag: str) -> None:
    if count > cap:
        raise bad_request(f"{name!r} holds {count} items; this server accepts at most {cap} ({flag})", name)


def check_token_ids(ids: list[int], vocab_size: int, name: str) -> None:
    """Token ids given by the client must be in the vocabulary."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"{name} token ids must be in [0, {vocab_size}); got {bad[:5]}", name)


def check_grammar_size(param: str, spec: str) -> None:
    """A structured-outputs schema, regex, grammar or choice list of at most :data:`MAX_GRAMMAR_CHARS`."""
    if len(spec) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"{param} is {len(spec)} characters long; at most {MAX_GRAMMAR_CHARS} are accepted", param)
