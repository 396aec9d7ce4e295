"""Store a step's new keys and values into the paged KV cache (``reshape_and_cache``).

A program copies ``BLOCK_T`` tokens × ``BLOCK_E`` of the ``H_kv * D`` elements of each token's
keys and values (element ``e`` is head ``e // D``, dim ``e % D``)::

    key    [T, H_kv, D]  row t ──┐
    value  [T, H_kv, D]  row t ──┤   slot = slot_mapping[t]   (negative: a padding token, skipped)
                                 ▼
    kv_cache [2, num_blocks, PAGE, H_kv, D]:  [0 | 1, slot // PAGE, slot % PAGE, e // D, e % D]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fw_triton_attention.tile_math import INTERPRET


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    num_elements,
    head_size,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    elements = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    head = elements // head_size
    dim = elements % head_size
    mask = (slots >= 0)[:, None] & (elements < num_elements)[None, :]
    dst = cache_ptr + ((slots // PAGE) * stride_cache_block + (slots % PAGE) * stride_cache_offset)[:, None]
    dst += (head * stride_cache_head + dim)[None, :]
    key = tl.load(key_ptr + tokens[:, None] * stride_key_token + (head * stride_key_head + dim)[None, :], mask=mask)
    tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(
        value_ptr + tokens[:, None] * stride_value_token + (head * stride_value_head + dim)[None, :], mask=mask
    )
    tl.store(dst + stride_cache_kv, value.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[T, H_kv, D]`` (last dim contiguous) into ``kv_cache`` at ``slot_mapping[:T]``."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1
    num_elements = num_kv_heads * head_size
    block_e = min(triton.next_power_of_2(num_elements), 1024)
    # ~8 KB of bf16 keys per program on a GPU; the interpreter pays per program, so give it more.
    block_t = min(max(1, (16384 if INTERPRET else 4096) // block_e), triton.next_power_of_2(num_tokens))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_elements, block_e))
    _store_kv_kernel[grid](
        key,
        value,
        kv_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_elements,
        head_size,
        PAGE=kv_cache.shape[2],
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        num_warps=4,
    )
