"""The state cache of hybrid models: slot bookkeeping in the scheduler (admission, finish, abort,
preemption) and the sizes the builder budgets. The model-level checks (states carried across
chunks, slots reused after abort and preemption, outputs equal to transformers) are in
``plugins/models/qwen3_next/tests``."""

from __future__ import annotations

import torch

from framework.config import SchedulerConfig
from framework.engine.kv_cache_manager import KVCacheManager
from framework.engine.request import FinishReason, Request
from framework.engine.scheduler import Scheduler
from framework.engine.state_cache import StateCacheSpec, StateSlotManager, num_state_slots
from framework.sampling_params import SamplingParams


def _request(name: str, num_tokens: int) -> Request:
    return Request(name, list(range(2, 2 + num_tokens)), SamplingParams(max_tokens=8))


def _scheduler(num_slots: int, num_blocks: int = 64, max_num_seqs: int = 4) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, prefill_chunk_size=64)
    return Scheduler(config, KVCacheManager(num_blocks, 4, enable_prefix_caching=False), StateSlotManager(num_slots))


def test_admitted_requests_get_distinct_slots_and_finishing_frees_them():
    scheduler = _scheduler(num_slots=4)
    requests = [_request(f"r{i}", 5) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    batch = scheduler.schedule()
    assert [r.state_slot for r in batch.requests] == [0, 1, 2]
    scheduler.finish(requests[1], FinishReason.ABORT)
    assert requests[1].state_slot == -1 and scheduler.state_slots.num_free_slots == 2
    late = _request("late", 3)
    scheduler.add(late)
    scheduler.schedule()
    assert late.state_slot == 1  # the freed slot is handed out first


def test_admission_waits_for_a_free_slot():
    scheduler = _scheduler(num_slots=2, max_num_seqs=4)
    requests = [_request(f"r{i}", 5) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    assert [r.request_id for r in scheduler.schedule().requests] == ["r0", "r1"]
    assert requests[2].state_slot == -1 and list(scheduler.waiting) == [requests[2]]
    scheduler.finish(requests[0], FinishReason.STOP)
    assert requests[2] in scheduler.schedule().requests
    assert requests[2].state_slot == 0


def test_preempted_request_gives_its_slot_back_and_gets_one_again_on_readmission():
    # 4 blocks of 4 tokens: two 7-token prompts fill them; growing past 8 tokens forces a preemption
    scheduler = _scheduler(num_slots=2, num_blocks=4)
    first, second = _request("first", 7), _request("second", 7)
    scheduler.add(first)
    scheduler.add(second)
    scheduler.schedule()
    for request in (first, second):
        request.num_computed_tokens = request.num_tokens
        request.output_token_ids += [5, 6]  # each now needs a third block
    batch = scheduler.schedule()
    assert batch.preempted == [second]
    assert second.state_slot == -1 and first.state_slot == 0
    assert scheduler.state_slots.num_free_slots == 1
    scheduler.finish(first, FinishReason.STOP)
    readmitted = scheduler.schedule()
    assert readmitted.requests == [second] and second.state_slot in (0, 1)
    assert second.num_computed_tokens == 0  # recomputed from scratch, so its state starts from zeros


def test_state_spec_bytes_and_the_slot_budget():
    spec = StateCacheSpec((96, 3), (4, 16, 8), torch.bfloat16)
    assert spec.bytes_per_slot == 96 * 3 * 2 + 4 * 16 * 8 * 4
    cache = spec.allocate(5, torch.device("cpu"))
    assert cache.conv.shape == (6, 96, 3) and cache.recurrent.shape == (6, 4, 16, 8)  # plus the spare row
    assert cache.recurrent.dtype == torch.float32 and not cache.recurrent.any()
    assert num_state_slots(256, 1000, None) == 256
    assert num_state_slots(256, 1000, 100_000) == 50  # half the budget
    assert num_state_slots(4, 1000, 100_000) == 4
