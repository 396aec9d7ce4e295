"""The per-step message rank 0 broadcasts to the tensor-parallel workers.

Small by construction: per scheduled request only the tokens it computes this step (one during
decode), its first position and the block ids the workers do not know yet (:class:`BlockTableSync`);
every rank builds its own input tensors from it.
"""

from __future__ import annotations

import msgspec


class StepInput(msgspec.Struct, array_like=True):
    """One request of a step: ``token_ids`` at positions ``start, start + 1, ...``, KV in ``block_ids``.

    In a :class:`StepMessage`, ``block_ids`` holds only the ids from index ``blocks_from`` on; the
    ones before are those the workers received for ``request_id`` in earlier steps.
    """

    token_ids: list[int]
    start: int
    block_ids: list[int]
    request_id: str = ""
    blocks_from: int = 0


class BlockTableSync:
    """Both sides' memory of each running request's block ids, so a step sends only the new ones.

    Rank 0 :meth:`compress` es each step's inputs, the workers :meth:`expand` them; both keep
    exactly the requests of the latest step (a request that skips a step, or was preempted and
    got new blocks, is sent whole again), so the two memories stay equal.
    """

    def __init__(self) -> None:
        self.known: dict[str, list[int]] = {}

    def compress(self, inputs: list[StepInput]) -> list[StepInput]:
        known, compact = {}, []
        for item in inputs:
            sent = self.known.get(item.request_id, [])
            start = len(sent) if item.block_ids[:len(sent)] == sent else 0
            compact.append(StepInput(item.token_ids, item.start, item.block_ids[start:], item.request_id, start))
            known[item.request_id] = list(item.block_ids)  # the request's own list grows later
        self.known = known
        return compact

    def expand(self, inputs: list[StepInput]) -> list[StepInput]:
        known, full = {}, []
        for item in inputs:
            block_ids = self.known.get(item.request_id, [])[:item.blocks_from] + item.block_ids
            full.append(StepInput(item.token_ids, item.start, block_ids, item.request_id))
            known[item.request_id] = block_ids
        self.known = known
        return full


class StepMessage(msgspec.Struct, array_like=True):
    """A model step: run ``inputs``, then ``compute_logits`` on each list of hidden rows in order,
    then (with ``sampling``) receive rank 0's sampled ids.

    Rank 0 calls ``compute_logits`` exactly on ``logits_rows`` (prompt logprobs, then the
    sampled rows), so every rank joins the same all-gathers. ``shutdown`` ends the workers.
    """

    inputs: list[StepInput] = []
    logits_rows: list[list[int]] = []
    shutdown: bool = False
    #: async scheduling: the indices (into ``inputs``) of the requests that sample; rank 0 then
    #: broadcasts their sampled ids on the device, and a later step's placeholder inputs read them
    sampling: list[int] = []
