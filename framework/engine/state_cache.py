"""The per-sequence state cache of linear-attention layers, beside the paged KV cache.

A hybrid model (Qwen3-Next, Qwen3.5) mixes paged-attention layers with gated-delta-net layers
(:class:`framework.layers.linear_attention.GatedDeltaNetAttention`), whose memory of the past is
a fixed-size state per sequence instead of a growing KV cache. Each running request holds one
*state slot*: the same row index in every linear layer's tensors::

    conv       [num_slots + 1, conv_dim, kernel - 1]           model dtype
    recurrent  [num_slots + 1, num_v_heads, k_dim, v_dim]      float32
                                 ^ the last row is spare (padding rows of a graphed batch)

Rules (the scheduler applies them): a request gets a slot when it is admitted and gives it back
when it finishes, is aborted or is preempted (preemption recomputes from token 0, so its state
is rebuilt). A slot's rows are never cleared: a sequence's first step (``num_computed_tokens ==
0``) starts from zeros, later steps (decode, the next prefill chunk) from the row. Prefix caching
is off for hybrid models: a cached KV prefix has no matching state to resume from.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from framework.engine.request import Request

log = logging.getLogger("fw.engine")


@dataclass(frozen=True, slots=True)
class StateCacheSpec:
    """The per-slot state of one linear-attention layer: the conv state (``conv_dtype``) and the
    recurrent state (``recurrent_dtype``, float32 by default)."""

    conv_shape: tuple[int, ...]
    recurrent_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    recurrent_dtype: torch.dtype = torch.float32

    @property
    def bytes_per_slot(self) -> int:
        def size(shape: tuple[int, ...], dtype: torch.dtype) -> int:
            return math.prod(shape) * torch.empty((), dtype=dtype).element_size()

        return size(self.conv_shape, self.conv_dtype) + size(self.recurrent_shape, self.recurrent_dtype)

    def allocate(self, num_slots: int, device: torch.device) -> StateCache:
        """Zeroed tensors of ``num_slots`` rows plus the spare one."""
        rows = num_slots + 1
        return StateCache(
            torch.zeros((rows, *self.conv_shape), dtype=self.conv_dtype, device=device),
            torch.zeros((rows, *self.recurrent_shape), dtype=self.recurrent_dtype, device=device),
        )


@dataclass(slots=True)
class StateCache:
    """One linear-attention layer's states, row ``slot`` per running sequence."""

    conv: torch.Tensor
    recurrent: torch.Tensor


class StateSlotManager:
    """Hands out state slots to requests (``request.state_slot``; -1 when it holds none).

    Invariant: a slot is in ``free_slots`` iff no request holds it. Freed slots are reused first
    (last freed, first reused), which keeps the touched rows few.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state cache needs at least one slot; got {num_slots}")
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def can_allocate(self, request: Request) -> bool:
        return request.state_slot >= 0 or bool(self.free_slots)

    def allocate(self, request: Request) -> bool:
        """Give ``request`` a slot if it has none; False when none is free."""
        if request.state_slot >= 0:
            return True
        if not self.free_slots:
            return False
        request.state_slot = self.free_slots.pop()
        return True

    def free(self, request: Request) -> None:
        """Take the request's slot back (nothing if it holds none)."""
        if request.state_slot >= 0:
            assert request.state_slot not in self.free_slots
            self.free_slots.append(request.state_slot)
            request.state_slot = -1


def state_cache_specs(model: torch.nn.Module, dtype: torch.dtype) -> list[StateCacheSpec]:
    """The specs of ``model``'s linear-attention layers in ``state_index`` order (empty: not hybrid)."""
    from framework.layers.linear_attention import GatedDeltaNetAttention

    layers = sorted((m for m in model.modules() if isinstance(m, GatedDeltaNetAttention)), key=lambda m: m.state_index)
    assert [m.state_index for m in layers] == list(range(len(layers))), "state indices must be 0..n-1"
    return [layer.state_spec(dtype) for layer in layers]


def allocate_state_caches(specs: list[StateCacheSpec], num_slots: int, device: torch.device) -> list[StateCache]:
    return [spec.allocate(num_slots, device) for spec in specs]


def num_state_slots(max_num_seqs: int, bytes_per_slot: int, budget_bytes: int | None) -> int:
    """Slots for ``max_num_seqs`` sequences, or fewer where their states would take more than half
    of ``budget_bytes`` (the rest stays for the KV cache); None: no budget to respect."""
    if budget_bytes is None or bytes_per_slot == 0:
        return max_num_seqs
    return max(1, min(max_num_seqs, budget_bytes // 2 // bytes_per_slot))


def log_plan(specs: list[StateCacheSpec], num_slots: int, max_num_seqs: int) -> None:
    """Log the state cache's size, and that it holds fewer sequences than ``--max-num-seqs`` if so."""
    per_slot = sum(spec.bytes_per_slot for spec in specs)
    log.info(
        "State cache: %d linear-attention layers, %d slots x %.2f MiB = %.1f MiB",
        len(specs),
        num_slots,
        per_slot / 2**20,
        num_slots * per_slot / 2**20,
    )
    if num_slots < max_num_seqs:
        log.warning(
            "the state cache holds %d sequences (half the memory budget), fewer than --max-num-seqs %d: "
            "at most %d requests run at once; raise --mem / --kv-fraction / --gpu-memory-utilization",
            num_slots,
            max_num_seqs,
            num_slots,
        )
