"""Rotary position embedding of query and key in one kernel launch.

Grid: ``(num_tokens, num_query_head_blocks + num_key_head_blocks)``; a program rotates a block of
heads of one token, of the query or of the key, reading that token's ``cos``/``sin`` row once::

    head (head_size features):  [ x[0] ... x[rotary_dim - 1] | x[rotary_dim] ... ]   <- passed through
    neox pairs:   (x[i], x[i + rotary_dim/2])     GPT-J pairs:  (x[2i], x[2i + 1])     i < rotary_dim/2
    cos_sin_cache row:  [ cos[0] ... cos[rotary_dim/2 - 1] | sin[0] ... sin[rotary_dim/2 - 1] ]

Outputs are new contiguous tensors (the inputs, often strided views of the fused QKV projection,
are only read), so the pass-through features are copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

#: Features per program and load: heads per program = this / (rotary_dim / 2), rounded to a power of two.
BLOCK_FEATURES = 1024


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, src_offset, dst_offset, head0, num_heads, cos, sin,
                  HEAD_SIZE: tl.constexpr, ROTARY_DIM: tl.constexpr, IS_NEOX: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    heads = head0 + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (i < ROTARY_DIM // 2)[None, :]
    if IS_NEOX:
        first, second = i, i + ROTARY_DIM // 2
    else:
        first, second = 2 * i, 2 * i + 1
    src = src_ptr + src_offset + heads[:, None] * HEAD_SIZE
    dst = dst_ptr + dst_offset + heads[:, None] * HEAD_SIZE
    x1 = tl.load(src + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second[None, :], mask=mask, other=0.0).to(tl.float32)
    out_dtype = dst_ptr.dtype.element_ty
    tl.store(dst + first[None, :], (x1 * cos - x2 * sin).to(out_dtype), mask=mask)
    tl.store(dst + second[None, :], (x2 * cos + x1 * sin).to(out_dtype), mask=mask)
    if ROTARY_DIM < HEAD_SIZE:  # partial rotary: copy the rest of each head
        j = ROTARY_DIM + tl.arange(0, BLOCK_PASS)
        pass_mask = (heads < num_heads)[:, None] & (j < HEAD_SIZE)[None, :]
        rest = tl.load(src + j[None, :], mask=pass_mask, other=0.0)
        tl.store(dst + j[None, :], rest.to(out_dtype), mask=pass_mask)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cache_ptr,
                   q_row_stride, k_row_stride, cache_row_stride, num_q_heads, num_k_heads, num_q_blocks,
                   HEAD_SIZE: tl.constexpr, ROTARY_DIM: tl.constexpr, IS_NEOX: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    position = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    row = cache_ptr + position * cache_row_stride
    cos = tl.load(row + i, mask=i < ROTARY_DIM // 2, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + ROTARY_DIM // 2 + i, mask=i < ROTARY_DIM // 2, other=0.0).to(tl.float32)[None, :]
    if block < num_q_blocks:
        _rotate_heads(q_ptr, q_out_ptr, token * q_row_stride, token * num_q_heads * HEAD_SIZE, block * BLOCK_H,
                      num_q_heads, cos, sin, HEAD_SIZE, ROTARY_DIM, IS_NEOX, BLOCK_H, BLOCK_HALF, BLOCK_PASS)
    else:
        _rotate_heads(k_ptr, k_out_ptr, token * k_row_stride, token * num_k_heads * HEAD_SIZE,
                      (block - num_q_blocks) * BLOCK_H, num_k_heads, cos, sin, HEAD_SIZE, ROTARY_DIM, IS_NEOX,
                      BLOCK_H, BLOCK_HALF, BLOCK_PASS)


def _token_rows(x: Tensor, num_tokens: int) -> Tensor:
    """``x`` as ``[num_tokens, heads * head_size]`` with unit feature stride (a view when the layout allows)."""
    rows = x.reshape(num_tokens, -1)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rotary_embedding(
    positions: Tensor,
    query: Tensor,
    key: Tensor,
    head_size: int,
    cos_sin_cache: Tensor,
    is_neox_style: bool,
) -> tuple[Tensor, Tensor]:
    """:func:`framework.ops.rotary_embedding` in one kernel; returns new ``(query, key)`` of the inputs' shapes and dtypes."""
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    num_tokens = positions.numel()
    if num_tokens == 0:
        return q_out, k_out
    q_rows, k_rows = _token_rows(query, num_tokens), _token_rows(key, num_tokens)
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    rotary_dim = cache.shape[-1]
    num_q_heads, num_k_heads = q_rows.shape[1] // head_size, k_rows.shape[1] // head_size
    block_half = triton.next_power_of_2(rotary_dim // 2)
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), max(1, BLOCK_FEATURES // block_half))
    num_q_blocks = triton.cdiv(num_q_heads, block_h)
    grid = (num_tokens, num_q_blocks + triton.cdiv(num_k_heads, block_h))
    _rotary_kernel[grid](
        positions.reshape(-1), q_rows, k_rows, q_out, k_out, cache,
        q_rows.stride(0), k_rows.stride(0), cache.stride(0), num_q_heads, num_k_heads, num_q_blocks,
        HEAD_SIZE=head_size, ROTARY_DIM=rotary_dim, IS_NEOX=is_neox_style, BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_PASS=triton.next_power_of_2(max(head_size - rotary_dim, 1)), num_warps=4)
    return q_out, k_out
