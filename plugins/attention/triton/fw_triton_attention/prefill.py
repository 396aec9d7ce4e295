"""Prefill / mixed attention over the paged cache: any query lengths, cached prefixes, GQA.

Grid ``(q_block, kv_head, request)``. A program takes ``BLOCK_Q`` consecutive query tokens of one
request and *all* the query heads that share one KV head (``GROUP`` of them, padded to
``GROUP_P2``), flattened into ``BLOCK_M = BLOCK_Q * GROUP_P2`` rows, so every K/V tile is loaded
once per KV-head group::

    row i ─► query token  q_block * BLOCK_Q + i // GROUP_P2      (of this request)
             query head   kv_head * GROUP   + i %  GROUP_P2      (rows with i % GROUP_P2 >= GROUP: padding)

The request's new tokens sit at the END of its sequence (``context = seq_len - query_len`` tokens
were cached before this step), so query token ``j`` is at absolute position ``context + j``::

    positions  0 ............ context-1 | context ........ seq_len-1
               cached prefix            | this step's queries (their K/V already stored)
    keys seen by query j:  max(0, pos_j - window + 1) .. pos_j      (.. span_end_j - 1 in a bidirectional span)

The program walks KV tiles of ``BLOCK_N`` positions from the window start of its first query to
its last query, looking up each position's page in the block table, with an online softmax.
Decode rows of a mixed batch are requests with ``query_len == 1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.kv_cache import KVCache
from fw_triton_attention.quant_tiles import cache_geometry, load_cache_tile
from fw_triton_attention.tile_math import INTERPRET, online_softmax_step


@triton.jit
def _prefill_attention_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    block_table_ptr,
    sinks_ptr,
    span_ends_ptr,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    scales_ptr,
    stride_scales_block,
    stride_scales_offset,
    stride_scales_head,
    stride_table,
    sm_scale,
    soft_cap,
    sliding_window,
    chunk_size,
    head_size,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_SPANS: tl.constexpr,
    FP32: tl.constexpr,
    KEY_FORMAT: tl.constexpr,
    VALUE_FORMAT: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P2
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + request)
    q_len = tl.load(cu_seqlens_q_ptr + request + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + request) - q_len

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + rows // GROUP_P2
    head_in_group = rows % GROUP_P2
    row_mask = (q_tok < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_size
    token = (q_start + q_tok).to(tl.int64)
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :], mask=io_mask, other=0.0
    )
    if FP32:
        q = q.to(tl.float32)
    elif KEY_FORMAT == 0:
        q = q.to(cache_ptr.dtype.element_ty)  # a quantized cache's tiles are dequantized to q's dtype
    q_pos = context_len + q_tok
    key_end = q_pos + 1  # one past each row's last key
    kv_end = context_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)  # one past the last query's position
    if USE_SPANS:  # a row inside a bidirectional span sees up to the span's end (within this step)
        key_end = tl.load(span_ends_ptr + token, mask=row_mask, other=0)
        kv_end = tl.maximum(kv_end, tl.max(key_end, axis=0))
    kv_start = 0
    if USE_WINDOW:
        first_pos = context_len + q_block * BLOCK_Q
        kv_start = tl.maximum(first_pos - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
    if USE_CHUNK:  # the block's first query sits in the earliest chunk: keys before it are never seen
        chunk_start = (context_len + q_block * BLOCK_Q) // chunk_size * chunk_size
        kv_start = tl.maximum(kv_start, chunk_start // BLOCK_N * BLOCK_N)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:  # the sink is a key of score `sink` and no value: start the running softmax from it
        m_i = tl.load(sinks_ptr + head, mask=row_mask, other=-1.0e30).to(tl.float32) * 1.4426950408889634
        l_i += 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_table_ptr + request.to(tl.int64) * stride_table
    for start in range(kv_start, kv_end, BLOCK_N):
        kv_pos = start + tl.arange(0, BLOCK_N)
        kv_mask = kv_pos < kv_end
        k, v = load_cache_tile(
            cache_ptr,
            scales_ptr,
            q_ptr,
            table_row,
            kv_pos,
            kv_mask,
            kv_head,
            dims,
            dim_mask,
            stride_cache_kv,
            stride_cache_block,
            stride_cache_offset,
            stride_cache_head,
            stride_scales_block,
            stride_scales_offset,
            stride_scales_head,
            PAGE,
            FP32,
            KEY_FORMAT,
            VALUE_FORMAT,
            KEY_BYTES,
            VALUE_BYTES,
        )
        allowed = (kv_pos[None, :] < key_end[:, None]) & kv_mask[None, :]
        if USE_WINDOW:
            allowed = allowed & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
        if USE_CHUNK:
            allowed = allowed & (kv_pos[None, :] >= (q_pos // chunk_size * chunk_size)[:, None])
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, allowed, sm_scale, soft_cap, USE_SOFT_CAP, FP32)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def _tiles(head_size: int, group_p2: int, max_query_len: int) -> tuple[int, int, int, int]:
    """``(BLOCK_Q, BLOCK_N, num_warps, num_stages)``: ~128 rows per program (H100/H200 flash-attention
    shapes), fewer when every request is short so decode rows of mixed batches waste little."""
    rows = 128 if head_size <= 128 else 64
    block_q = max(1, rows // group_p2)
    block_q = min(block_q, max(triton.next_power_of_2(max_query_len), 16 // group_p2, 1))
    block_n = 64 if head_size <= 128 else 32
    if INTERPRET:
        block_n = 128  # the interpreter pays per tile iteration, not per element
    num_warps = 8 if block_q * group_p2 >= 128 else 4
    return block_q, block_n, num_warps, 3 if head_size <= 128 else 2


def prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor | KVCache,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_reqs: int,
    max_query_len: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    span_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` ``[T, H, D]`` (requests' new tokens, contiguous per request) over the cache.

    ``max_query_len`` (a host int) sizes the grid, so nothing syncs with the device. A quantized
    :class:`~framework.kv_cache.KVCache` is read from its packed rows, as in ``decode_attention``.
    ``sinks`` ``[H]``: per-head sink logits (see ``AttentionBackend.forward``). ``chunk_size``:
    chunked local attention, keys of the query's own chunk only (Llama 4). ``span_ends`` ``[T]``
    int32: bidirectional spans, each token's keys end there instead of at its own position
    (``AttentionMetadata.span_ends``; a span lies within its request's step).
    """
    num_tokens, num_heads, head_size = query.shape
    cache = cache_geometry(kv_cache)
    num_kv_heads = cache.num_kv_heads
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    out = torch.empty_like(query) if out is None else out
    if num_tokens == 0 or num_reqs == 0:
        return out
    block_q, block_n, num_warps, num_stages = _tiles(head_size, group_p2, max_query_len)
    grid = (triton.cdiv(max_query_len, block_q), num_kv_heads, num_reqs)
    _prefill_attention_kernel[grid](
        query,
        cache.data,
        out,
        cu_seqlens_q,
        seq_lens,
        block_table,
        block_table if sinks is None else sinks,
        block_table if span_ends is None else span_ends,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *cache.strides,
        cache.scales,
        *cache.scale_strides,
        block_table.stride(0),
        sm_scale,
        soft_cap or 1.0,
        sliding_window or 0,
        chunk_size or 1,
        head_size,
        GROUP=group,
        GROUP_P2=group_p2,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_size)),
        PAGE=cache.page,
        USE_WINDOW=bool(sliding_window),
        USE_CHUNK=bool(chunk_size),
        USE_SOFT_CAP=bool(soft_cap),
        USE_SINKS=sinks is not None,
        USE_SPANS=span_ends is not None,
        FP32=INTERPRET or query.dtype == torch.float32,
        **cache.constexprs,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
