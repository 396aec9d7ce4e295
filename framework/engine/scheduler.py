"""Token-budget continuous batching with chunked prefill and preemption by recompute.

There is no prefill or decode phase: each step, every running request gets the tokens it still
needs (``num_tokens - num_computed_tokens``), capped by the prefill chunk size and the step's
token budget; then waiting requests are admitted while budget, sequence slots and blocks last.
When a running request cannot get a block, the newest running request is preempted (its blocks
freed, to be recomputed later — usually from the prefix cache). A bidirectional image span
(Gemma 3) is never split across steps (:func:`~framework.engine.multimodal_step.whole_span_tokens`).

Hybrid models (linear-attention layers beside paged attention) also give each running request a
state slot (:class:`~framework.engine.state_cache.StateSlotManager`): taken on admission, given
back on finish, abort and preemption, like the blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from framework.config import SchedulerConfig
from framework.engine.kv_cache_manager import KVCacheManager
from framework.engine.multimodal_step import whole_span_tokens
from framework.engine.request import FinishReason, Request, RequestStatus
from framework.engine.state_cache import StateSlotManager


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: requests in execution order and how many tokens each computes."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    """Owns the waiting and running queues; decides each step's batch."""

    def __init__(
        self, config: SchedulerConfig, kv_cache: KVCacheManager, state_slots: StateSlotManager | None = None
    ) -> None:
        """``state_slots``: the state-cache slots of a hybrid model (None: a paged-attention-only model)."""
        self.config = config
        self.kv_cache = kv_cache
        self.state_slots = state_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _tokens_wanted(self, request: Request, budget: int) -> int:
        num_new = min(request.num_tokens - request.num_computed_tokens, self.config.prefill_chunk_size, budget)
        return whole_span_tokens(request, num_new, budget) if request.images else num_new

    def schedule(self) -> ScheduledBatch:
        """Pick this step's batch and allocate its blocks."""
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.num_output_tokens >= request.max_tokens:
                index += 1  # its last token is in flight (async scheduling): nothing more to compute
                continue
            num_new = self._tokens_wanted(request, budget)
            if num_new == 0:
                index += 1  # a bidirectional image span that this step's budget cannot hold whole
                continue
            while not self.kv_cache.allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    break
            else:
                batch.requests.append(request)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                index += 1
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        return batch

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self.state_slots is not None and not self.state_slots.can_allocate(request):
                break  # every slot is held by a running request
            if not request.block_ids:
                request.num_computed_tokens = self.kv_cache.allocate_cached_prefix(request)
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = request.num_computed_tokens
            num_new = self._tokens_wanted(request, budget)
            if num_new == 0 or not self.kv_cache.allocate(request, num_new):
                break  # keep FCFS order: the head waits for blocks, cached blocks stay attached
            self.waiting.popleft()
            if self.state_slots is not None:
                self.state_slots.allocate(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.requests.append(request)
            batch.num_new_tokens.append(num_new)
            budget -= num_new

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        self._free_state(request)  # recomputed from token 0: its state is rebuilt
        request.num_computed_tokens = 0
        request.pooled = None
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Remove a request from whichever queue holds it and free its blocks (and state slot)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        self._free_state(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _free_state(self, request: Request) -> None:
        if self.state_slots is not None:
            self.state_slots.free(request)
