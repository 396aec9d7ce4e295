"""Rotary position embedding of query and key in one kernel launch.

Grid: ``(num_tokens, num_query_head_blocks + num_key_head_blocks)``; a program rotates a block of
heads of one token, of the query or of the key, reading that token's ``cos``/``sin`` row once::

    head (head_size features):  [ x[0] ... x[rotary_dim - 1] | x[rotary_dim] ... ]   <- passed through
    neox pairs:   (x[i], x[i + rotary_dim/2])     GPT-J pairs:  (x[2i], x[2i + 1])     i < rotary_dim/2
    cos_sin_cache row:  [ cos[0] ... cos[rotary_dim/2 - 1] | sin[0] ... sin[rotary_dim/2 - 1] ]

Outputs are new contiguous tensors (the inputs, often strided views of the fused QKV projection,
are only read), so the pass-through features are copied.

:func:`qk_norm_rotary_embedding` runs the same kernel with ``HAS_NORM``: each head is first
RMS-normalised over all its features (Qwen3 / Gemma 3 QK norm), rounded as
:func:`framework.ops.rms_norm` rounds, and then rotated: one launch instead of three.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

#: Features per program and load: heads per program = this / (rotary_dim / 2), rounded to a power of two.
BLOCK_FEATURES = 1024


@triton.jit
def _norm_heads(
    x1,
    x2,
    rest,
    w_ptr,
    first,
    second,
    j,
    eps,
    offset,
    OUT_DTYPE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HAS_REST: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
):
    """RMS norm of each head (rows of ``x1``/``x2``/``rest``: its features, float32, zeros where
    masked) with the weight at ``w_ptr``; returns the parts in float32, rounded as the reference."""
    squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    if HAS_REST:
        squares += tl.sum(rest * rest, axis=1)
    rstd = tl.rsqrt(squares / HEAD_SIZE + eps)[:, None]
    w1 = tl.load(w_ptr + first, mask=first < HEAD_SIZE, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + second, mask=second < HEAD_SIZE, other=0.0).to(tl.float32)[None, :]
    if HAS_OFFSET:  # Gemma: scale by (offset + w) in float32, round once
        x1, x2 = x1 * rstd * (offset + w1), x2 * rstd * (offset + w2)
    else:  # Llama/Qwen: round the normalised values, then scale
        x1 = (x1 * rstd).to(OUT_DTYPE).to(tl.float32) * w1
        x2 = (x2 * rstd).to(OUT_DTYPE).to(tl.float32) * w2
    if HAS_REST:
        wr = tl.load(w_ptr + j, mask=j < HEAD_SIZE, other=0.0).to(tl.float32)[None, :]
        if HAS_OFFSET:
            rest = rest * rstd * (offset + wr)
        else:
            rest = (rest * rstd).to(OUT_DTYPE).to(tl.float32) * wr
    # the norm's output is stored in the activation dtype before the rotation reads it
    return (x1.to(OUT_DTYPE).to(tl.float32), x2.to(OUT_DTYPE).to(tl.float32), rest.to(OUT_DTYPE).to(tl.float32))


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    src_offset,
    dst_offset,
    head0,
    num_heads,
    cos,
    sin,
    w_ptr,
    eps,
    offset,
    HEAD_SIZE: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
):
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
    j = ROTARY_DIM + tl.arange(0, BLOCK_PASS)
    pass_mask = (heads < num_heads)[:, None] & (j < HEAD_SIZE)[None, :]
    if ROTARY_DIM < HEAD_SIZE:  # partial rotary: the rest of each head passes through
        rest = tl.load(src + j[None, :], mask=pass_mask, other=0.0).to(tl.float32)
    else:
        rest = tl.zeros([BLOCK_H, BLOCK_PASS], dtype=tl.float32)
    if HAS_NORM:
        x1, x2, rest = _norm_heads(
            x1, x2, rest, w_ptr, first, second, j, eps, offset, out_dtype, HEAD_SIZE, ROTARY_DIM < HEAD_SIZE, HAS_OFFSET
        )
    tl.store(dst + first[None, :], (x1 * cos - x2 * sin).to(out_dtype), mask=mask)
    tl.store(dst + second[None, :], (x2 * cos + x1 * sin).to(out_dtype), mask=mask)
    if ROTARY_DIM < HEAD_SIZE:
        tl.store(dst + j[None, :], rest.to(out_dtype), mask=pass_mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cache_ptr,
    q_w_ptr,
    k_w_ptr,
    eps,
    offset,
    q_row_stride,
    k_row_stride,
    cache_row_stride,
    num_q_heads,
    num_k_heads,
    num_q_blocks,
    HEAD_SIZE: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    position = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    row = cache_ptr + position * cache_row_stride
    cos = tl.load(row + i, mask=i < ROTARY_DIM // 2, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + ROTARY_DIM // 2 + i, mask=i < ROTARY_DIM // 2, other=0.0).to(tl.float32)[None, :]
    if block < num_q_blocks:
        _rotate_heads(
            q_ptr,
            q_out_ptr,
            token * q_row_stride,
            token * num_q_heads * HEAD_SIZE,
            block * BLOCK_H,
            num_q_heads,
            cos,
            sin,
            q_w_ptr,
            eps,
            offset,
            HEAD_SIZE,
            ROTARY_DIM,
            IS_NEOX,
            BLOCK_H,
            BLOCK_HALF,
            BLOCK_PASS,
            HAS_NORM,
            HAS_OFFSET,
        )
    else:
        _rotate_heads(
            k_ptr,
            k_out_ptr,
            token * k_row_stride,
            token * num_k_heads * HEAD_SIZE,
            (block - num_q_blocks) * BLOCK_H,
            num_k_heads,
            cos,
            sin,
            k_w_ptr,
            eps,
            offset,
            HEAD_SIZE,
            ROTARY_DIM,
            IS_NEOX,
            BLOCK_H,
            BLOCK_HALF,
            BLOCK_PASS,
            HAS_NORM,
            HAS_OFFSET,
        )


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
    return _launch(positions, query, key, head_size, cos_sin_cache, is_neox_style)


def qk_norm_rotary_embedding(
    positions: Tensor,
    query: Tensor,
    key: Tensor,
    head_size: int,
    cos_sin_cache: Tensor,
    is_neox_style: bool,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    offset: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """:func:`framework.ops.qk_norm_rotary_embedding` (per-head RMS norm, then rotary) in one kernel."""
    return _launch(positions, query, key, head_size, cos_sin_cache, is_neox_style, (q_weight, k_weight, eps, offset))


def _launch(
    positions: Tensor,
    query: Tensor,
    key: Tensor,
    head_size: int,
    cos_sin_cache: Tensor,
    is_neox_style: bool,
    norm: tuple[Tensor, Tensor, float, float] | None = None,
) -> tuple[Tensor, Tensor]:
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
    q_weight, k_weight, eps, offset = norm if norm is not None else (cache, cache, 0.0, 0.0)  # unread without a norm
    _rotary_kernel[grid](
        positions.reshape(-1),
        q_rows,
        k_rows,
        q_out,
        k_out,
        cache,
        q_weight.contiguous(),
        k_weight.contiguous(),
        float(eps),
        float(offset),
        q_rows.stride(0),
        k_rows.stride(0),
        cache.stride(0),
        num_q_heads,
        num_k_heads,
        num_q_blocks,
        HEAD_SIZE=head_size,
        ROTARY_DIM=rotary_dim,
        IS_NEOX=is_neox_style,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_PASS=triton.next_power_of_2(max(head_size - rotary_dim, 1)),
        HAS_NORM=norm is not None,
        HAS_OFFSET=norm is not None and offset != 0.0,
        num_warps=4,
    )
    return q_out, k_out
