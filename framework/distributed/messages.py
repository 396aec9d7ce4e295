"""The per-step message rank 0 broadcasts to the tensor-parallel workers.

Small by construction: per scheduled request only the tokens it computes this step (one during
decode), its first position and its block ids; every rank builds its own input tensors from it.
"""

from __future__ import annotations

import msgspec


class StepInput(msgspec.Struct, array_like=True):
    """One request of a step: ``token_ids`` at positions ``start, start + 1, ...``, KV in ``block_ids``."""

    token_ids: list[int]
    start: int
    block_ids: list[int]


class StepMessage(msgspec.Struct, array_like=True):
    """A model step: run ``inputs``, then ``compute_logits`` on each list of hidden rows in order.

    Rank 0 calls ``compute_logits`` exactly on ``logits_rows`` (prompt logprobs, then the
    sampled rows), so every rank joins the same all-gathers. ``shutdown`` ends the workers.
    """

    inputs: list[StepInput] = []
    logits_rows: list[list[int]] = []
    shutdown: bool = False
