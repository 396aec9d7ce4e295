"""Prefill / mixed multi-head latent attention over the ``"mla"`` cache: any query lengths, cached prefixes.

The latents of the step are stored first (:func:`~fw_triton_attention.mla_decode.store_latent`);
then grid ``(q_block, head_block, request)``: a program takes ``BLOCK_Q`` consecutive query tokens
of one request times ``BLOCK_H`` heads, flattened into ``BLOCK_M = BLOCK_Q * BLOCK_H`` rows, so each
latent tile it loads serves every one of them (all heads share the latent: MLA is multi-query
attention over it)::

    row i ─► query token  q_block * BLOCK_Q + i // BLOCK_H      (of this request)
             query head   head_block * BLOCK_H + i % BLOCK_H    (heads >= num_heads: padding)

The request's new tokens sit at the end of its sequence (``context = seq_len - query_len`` tokens
were cached before: a prefix-cache hit or an earlier prefill chunk), so query token ``j`` is at
position ``context + j`` and sees positions ``0 .. context + j`` (causal)::

    positions  0 ............ context-1 | context ........ seq_len-1
               cached prefix            | this step's queries (their latents already stored)

Decode rows of a mixed batch are requests with ``query_len == 1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fw_triton_attention.tile_math import INTERPRET, fold_scores, latent_scores, load_latent_tile


@triton.jit
def _mla_prefill_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    block_table_ptr,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_offset,
    stride_table,
    sm_scale,
    num_heads,
    rank,
    rope,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr,
    FP32: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    q_block = tl.program_id(0)
    head_block = tl.program_id(1)
    request = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + request)
    q_len = tl.load(cu_seqlens_q_ptr + request + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + request) - q_len

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + rows // BLOCK_H
    head = head_block * BLOCK_H + rows % BLOCK_H
    row_mask = (q_tok < q_len) & (head < num_heads)
    token = (q_start + q_tok).to(tl.int64)
    lat = tl.arange(0, BLOCK_L)
    lat_mask = lat < rank
    rot = tl.arange(0, BLOCK_R)
    rot_mask = rot < rope
    q_rows = q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head
    q_lat = tl.load(q_rows + lat[None, :], mask=row_mask[:, None] & lat_mask[None, :], other=0.0)
    q_rot = tl.load(q_rows + rank + rot[None, :], mask=row_mask[:, None] & rot_mask[None, :], other=0.0)
    if FP32:
        q_lat = q_lat.to(tl.float32)
        q_rot = q_rot.to(tl.float32)
    else:
        q_lat = q_lat.to(cache_ptr.dtype.element_ty)
        q_rot = q_rot.to(cache_ptr.dtype.element_ty)
    q_pos = context_len + q_tok
    kv_end = context_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)  # one past the last query's position

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    table_row = block_table_ptr + request.to(tl.int64) * stride_table
    for start in range(0, kv_end, BLOCK_N):
        kv_pos = start + tl.arange(0, BLOCK_N)
        kv_mask = kv_pos < kv_end
        c_kv, k_pe = load_latent_tile(
            cache_ptr,
            table_row,
            kv_pos,
            kv_mask,
            lat,
            lat_mask,
            rot,
            rot_mask,
            rank,
            stride_cache_block,
            stride_cache_offset,
            PAGE,
            FP32,
        )
        scores = latent_scores(q_lat, q_rot, c_kv, k_pe, sm_scale, FP32)
        allowed = (kv_pos[None, :] <= q_pos[:, None]) & kv_mask[None, :]
        acc, m_i, l_i = fold_scores(acc, m_i, l_i, scores, c_kv, allowed, FP32)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_rows = out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head
    tl.store(out_rows + lat[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & lat_mask[None, :])


def mla_prefill_tiles(rank: int, num_heads: int, max_query_len: int) -> tuple[int, int, int, int, int]:
    """``(BLOCK_Q, BLOCK_H, BLOCK_N, num_warps, num_stages)``: 64 rows of (token, head) per program
    for a 512-wide latent (the fp32 accumulator is 64 x 512), 128 for smaller ones; fewer query
    tokens per program when every request is short (decode rows of mixed batches)."""
    block_h = min(triton.next_power_of_2(num_heads), 16)
    rows = 64 if rank >= 256 else 128
    block_q = max(1, rows // block_h)
    block_q = min(block_q, max(triton.next_power_of_2(max_query_len), triton.cdiv(16, block_h)))
    block_n = 128 if INTERPRET else (32 if rank >= 256 else 64)
    return block_q, block_h, block_n, 8 if block_q * block_h >= 64 else 4, 2


def mla_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    rank: int,
    num_reqs: int,
    max_query_len: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal MLA of absorbed queries ``[T, H, L + R]`` (each request's new tokens, contiguous, their
    latents already in the cache) over the ``"mla"`` cache; returns ``[T, H, L]`` (``L = rank``).
    ``max_query_len`` (a host int) sizes the grid: nothing syncs with the device."""
    num_tokens, num_heads, latent_size = query.shape
    out = query.new_empty(num_tokens, num_heads, rank) if out is None else out
    if num_tokens == 0 or num_reqs == 0:
        return out
    block_q, block_h, block_n, num_warps, num_stages = mla_prefill_tiles(rank, num_heads, max_query_len)
    grid = (triton.cdiv(max_query_len, block_q), triton.cdiv(num_heads, block_h), num_reqs)
    _mla_prefill_kernel[grid](
        query,
        kv_cache,
        out,
        cu_seqlens_q,
        seq_lens,
        block_table,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        sm_scale,
        num_heads,
        rank,
        latent_size - rank,
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_L=max(16, triton.next_power_of_2(rank)),
        BLOCK_R=max(16, triton.next_power_of_2(latent_size - rank)),
        PAGE=kv_cache.shape[1],
        FP32=INTERPRET or query.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
