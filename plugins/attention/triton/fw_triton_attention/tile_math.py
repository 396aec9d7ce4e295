"""The Triton helpers the attention kernels share: paged K/V tile loads and one online-softmax step.

Scores live in the log2 domain (multiplied by ``log2(e)``) so the kernels use ``exp2``; a row's
running maximum starts at ``-1e30`` (finite, not ``-inf``) so a tile in which a row sees no
allowed key adds exactly zero instead of ``exp2(-inf - -inf) = nan``.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

#: Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors through numpy, which computes bf16
#: wrongly: every load is then cast to float32 and dots run in full fp32 (``FP32`` constexpr).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def paged_kv_offsets(
    block_table_row_ptr,
    kv_pos,
    kv_mask,
    kv_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    PAGE: tl.constexpr,
):
    """Element offsets (int64) of the K rows of positions ``kv_pos`` of one sequence, one KV head.

    ::

        position p ──► block_table_row[p // PAGE] = page      (physical block of the cache)
                       p % PAGE                    = offset   (row inside the block)
        key element d of head h:  cache[0, page, offset, h, d]; the value sits stride_cache_kv later
    """
    page = tl.load(block_table_row_ptr + kv_pos // PAGE, mask=kv_mask, other=0)
    return page.to(tl.int64) * stride_cache_block + (kv_pos % PAGE) * stride_cache_offset + kv_head * stride_cache_head


@triton.jit
def load_kv_tile(
    cache_ptr,
    table_row,
    kv_pos,
    kv_mask,
    kv_head,
    dims,
    dim_mask,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_cache_kv,
    PAGE: tl.constexpr,
    FP32: tl.constexpr,
):
    """Keys and values ``[BLOCK_N, BLOCK_D]`` of positions ``kv_pos`` (masked rows read as 0).

    With ``FP32`` the tiles are cast to float32 (fp32 inputs, and the interpreter, which computes
    bf16 wrongly); otherwise they stay in the cache dtype for tensor-core dots.
    """
    offsets = paged_kv_offsets(
        table_row, kv_pos, kv_mask, kv_head, stride_cache_block, stride_cache_offset, stride_cache_head, PAGE
    )
    tile_mask = kv_mask[:, None] & dim_mask[None, :]
    k = tl.load(cache_ptr + offsets[:, None] + dims[None, :], mask=tile_mask, other=0.0)
    v = tl.load(cache_ptr + stride_cache_kv + offsets[:, None] + dims[None, :], mask=tile_mask, other=0.0)
    if FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def soft_cap_scores(scores, soft_cap):
    """``soft_cap * tanh(scores / soft_cap)``, written with ``exp`` so it runs compiled and interpreted."""
    return soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / soft_cap) + 1.0))


@triton.jit
def online_softmax_step(
    acc, m_i, l_i, q, k, v, allowed, sm_scale, soft_cap, USE_SOFT_CAP: tl.constexpr, FP32: tl.constexpr
):
    """Fold one KV tile into the running ``(acc [M, D], max m_i [M], sum l_i [M])`` of flash attention.

    ``q`` ``[M, D]``, ``k``/``v`` ``[N, D]``, ``allowed`` ``[M, N]`` (causal, window and bounds masks).
    Returns the updated triple; the caller divides ``acc`` by ``l_i`` at the end.
    """
    if FP32:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))  # fp16/bf16 tensor cores, fp32 accumulation
    if USE_SOFT_CAP:
        scores = soft_cap_scores(scores * sm_scale, soft_cap) * 1.4426950408889634
    else:
        scores = scores * (sm_scale * 1.4426950408889634)
    return fold_scores(acc, m_i, l_i, scores, v, allowed, FP32)


#: The decode over quantized tiles multiplies its probabilities by this (and divides the sums
#: back at the end) before rounding them to float16 for the dot: a probability times a small
#: value scale then stays a normal float16, not a subnormal that keeps few bits.
SCALED_P_BOOST: tl.constexpr = tl.constexpr(64.0)


@triton.jit
def scaled_softmax_step(
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
    key_scale,
    value_scale,
    allowed,
    sm_scale,
    soft_cap,
    USE_SOFT_CAP: tl.constexpr,
    FP32: tl.constexpr,
):
    """:func:`online_softmax_step` over tiles in scale units (``k``/``v`` ``[N, D]``, float16, or
    float32 with ``FP32``; ``q`` in their dtype) with per-row scales ``[N]``: the scores are
    multiplied by ``key_scale`` and the probabilities by ``value_scale`` (and
    :data:`SCALED_P_BOOST`: the caller divides ``acc`` by it once, at the end), so no element of a
    tile is scaled."""
    if FP32:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))  # float16 tensor cores, fp32 accumulation
    scores = scores * key_scale[None, :]
    if USE_SOFT_CAP:
        scores = soft_cap_scores(scores * sm_scale, soft_cap) * 1.4426950408889634
    else:
        scores = scores * (sm_scale * 1.4426950408889634)
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    weights = p * (value_scale * SCALED_P_BOOST)[None, :]
    if FP32:
        pv = tl.dot(weights, v, input_precision="ieee")
    else:
        pv = tl.dot(weights.to(v.dtype), v)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def load_latent_tile(
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
    PAGE: tl.constexpr,
    FP32: tl.constexpr,
):
    """The cached latents of positions ``kv_pos`` of one sequence (``"mla"`` layout, masked rows read as 0):
    ``c_kv`` ``[BLOCK_N, BLOCK_L]`` (features ``lat``; also the values) and ``k_pe`` ``[BLOCK_N, BLOCK_R]``
    (features ``rank + rot``)::

        cache [num_blocks, PAGE, L + R]:  page = block_table_row[p // PAGE], row p % PAGE = [ c_kv (L) | k_pe (R) ]
    """
    page = tl.load(table_row + kv_pos // PAGE, mask=kv_mask, other=0).to(tl.int64)
    rows = cache_ptr + page * stride_cache_block + (kv_pos % PAGE) * stride_cache_offset
    c_kv = tl.load(rows[:, None] + lat[None, :], mask=kv_mask[:, None] & lat_mask[None, :], other=0.0)
    k_pe = tl.load(rows[:, None] + rank + rot[None, :], mask=kv_mask[:, None] & rot_mask[None, :], other=0.0)
    if FP32:
        c_kv = c_kv.to(tl.float32)
        k_pe = k_pe.to(tl.float32)
    return c_kv, k_pe


@triton.jit
def latent_scores(q_lat, q_rot, c_kv, k_pe, sm_scale, FP32: tl.constexpr):
    """MLA scores ``[M, N]`` in the log2 domain: ``(q_lat . c_kv + q_rot . k_pe) * sm_scale * log2(e)``."""
    if FP32:
        scores = tl.dot(q_lat, tl.trans(c_kv), input_precision="ieee")
        scores += tl.dot(q_rot, tl.trans(k_pe), input_precision="ieee")
    else:
        scores = tl.dot(q_lat, tl.trans(c_kv))
        scores = tl.dot(q_rot, tl.trans(k_pe), scores)
    return scores * (sm_scale * 1.4426950408889634)


@triton.jit
def fold_scores(acc, m_i, l_i, scores, v, allowed, FP32: tl.constexpr):
    """Fold a tile's log2-domain ``scores`` ``[M, N]`` (``allowed`` masks them) and values ``v`` ``[N, D]``
    into the running ``(acc, m_i, l_i)``, as :func:`online_softmax_step` does after its dot."""
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv, m_new, l_i
