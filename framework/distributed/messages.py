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
    state_slot: int = -1  # hybrid models: the request's state-cache slot (-1: none)


class BlockTableSync:
    """Both sides' memory of each running request's block ids, so a step sends only the new ones.

    Rank 0 :meth:`compress` es each step's inputs, the workers :meth:`expand` them; both keep
    exactly the requests of the latest step (a request that skips a step, or was preempted and
    got new blocks, is sent whole again), so the two memories stay equal. Each step costs time
    in the new ids only: rank 0 relies on ``Request.block_ids`` growing by appends while the
    request runs and being replaced by a new list when its blocks are freed, so the same list
    object with at least as many ids as were sent still starts with them.
    """

    def __init__(self) -> None:
        #: rank 0: request id -> (its block list object, how many of its ids the workers have)
        self.sent: dict[str, tuple[list[int], int]] = {}
        #: workers: request id -> its block ids (extended in place)
        self.tables: dict[str, list[int]] = {}

    def compress(self, inputs: list[StepInput]) -> list[StepInput]:
        sent, compact = {}, []
        for item in inputs:
            table, count = self.sent.get(item.request_id, (None, 0))
            start = count if table is item.block_ids and len(table) >= count else 0
            compact.append(
                StepInput(item.token_ids, item.start, item.block_ids[start:], item.request_id, start, item.state_slot)
            )
            sent[item.request_id] = (item.block_ids, len(item.block_ids))
        self.sent = sent
        return compact

    def expand(self, inputs: list[StepInput]) -> list[StepInput]:
        tables, full = {}, []
        for item in inputs:
            table = self.tables.get(item.request_id)
            if table is not None and len(table) == item.blocks_from:
                table.extend(item.block_ids)
            else:
                table = (table or [])[: item.blocks_from] + item.block_ids
            full.append(StepInput(item.token_ids, item.start, table, item.request_id, state_slot=item.state_slot))
            tables[item.request_id] = table
        self.tables = tables
        return full


class StepMessage(msgspec.Struct, array_like=True):
    """A model step: run ``inputs``, then ``compute_logits`` on each list of hidden rows in order,
    then (with ``sampling``) receive rank 0's sampled ids.

    Rank 0 calls ``compute_logits`` exactly on ``logits_rows`` (prompt logprobs, then the
    sampled rows), so every rank joins the same logits gathers to rank 0. ``shutdown`` ends the workers.
    """

    inputs: list[StepInput] = []
    logits_rows: list[list[int]] = []
    shutdown: bool = False
    #: async scheduling: the indices (into ``inputs``) of the requests that sample; rank 0 then
    #: broadcasts their sampled ids on the device, and a later step's placeholder inputs read them
    sampling: list[int] = []
