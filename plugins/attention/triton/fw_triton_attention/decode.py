"""Decode attention (one query token per request) with split-KV, flash-decoding style.

At batch 1 a request has only ``num_kv_heads`` programs' worth of work per step; splitting its
context into ``S`` segments processed by separate programs keeps all SMs streaming K/V. Grid
``(request, kv_head, split)``; each program holds the ``GROUP`` query heads of its KV head as the
rows of one tile (padded to ``BLOCK_H >= 16`` for the tensor-core dot)::

    keys of request r (the query sits at position seq_len - 1):
      lo = max(0, seq_len - window)                                   (0 without a window)
      |<---- seg ---->|<---- seg ---->|<---- seg ---->|<- seg ->|      seg = ceil((seq_len - lo) / S),
      lo  split 0       split 1         split 2         split 3  seq_len   rounded up to BLOCK_N
    each split writes its unnormalised (acc [GROUP, D], max m, sum l) in fp32;
    the reduce kernel combines them: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.

The segment length is computed in the kernel from ``seq_len``, so any ``S`` is correct for any
context (surplus splits find an empty segment and contribute nothing); the host picks ``S`` from
the batch shape only, which keeps a captured CUDA graph valid as contexts grow. With ``S == 1``
the kernel normalises and writes the output itself and no reduce runs.

Fused store (``key``/``value``/``slot_mapping`` given, as the backend does for decode-only steps):
the step's new K/V row of request ``r`` (row ``r``: one token per request) is the key at
``seq_len - 1``. Every program takes it from the row instead of the cache (the cache load of that
position is masked), and the one program whose segment holds ``seq_len - 1`` writes it into the
cache at ``slot_mapping[r]`` after its loop (a negative slot, padding, writes nothing, as in
``kv_store.py``). No other program reads that slot, so there is no race, and the separate
``store_kv`` launch per layer is saved::

    positions   kv_lo ............................ seq_len-2 | seq_len-1
    K/V from    cache (paged, block table)                    | key[r], value[r]  -> cache[slot_mapping[r]]
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from framework import kv_quant
from framework.kv_cache import KVCache
from fw_triton_attention.quant_tiles import cache_geometry, load_quant_units_tile
from fw_triton_attention.tile_math import (
    INTERPRET,
    SCALED_P_BOOST,
    load_kv_tile,
    online_softmax_step,
    scaled_softmax_step,
)

#: A split streams at least this many keys (fewer would spend more on the reduce than it saves).
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
#: Decode tiles of a model-dtype cache: (keys per tile, warps, programs per SM the splits aim for).
MODEL_DTYPE_TILES = (64, 4, 2)
#: The same per key format code of a quantized cache (head size <= 128). A decode step is bound by
#: the bytes in flight: a tile of 64 fp8 rows carries half a bf16 tile's bytes and an int4 tile a
#: quarter, so with bf16's tiles and split count the quantized caches streamed no faster than bf16
#: (ddb3fb2 on the H200: fp8 at 0.97x auto at 32k). Longer tiles and more programs per SM keep as
#: many bytes in flight; ``benchmarks/kv_decode_kernels.py`` sweeps them on the GPU.
QUANT_DECODE_TILES = {8: (128, 8, 4), 4: (128, 8, 4), 3: (64, 4, 2)}


@triton.jit
def _decode_attention_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    seq_lens_ptr,
    block_table_ptr,
    new_k_ptr,
    new_v_ptr,
    slot_mapping_ptr,
    sinks_ptr,
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
    stride_new_k_token,
    stride_new_k_head,
    stride_new_v_token,
    stride_new_v_head,
    sm_scale,
    soft_cap,
    sliding_window,
    chunk_size,
    head_size,
    num_heads,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    STORE_NEW_KV: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    FP32: tl.constexpr,
    KEY_FORMAT: tl.constexpr,
    VALUE_FORMAT: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
):
    request = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + request)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(seq_len - sliding_window, 0)
    if USE_CHUNK:  # chunked local attention: from the start of the query's chunk
        kv_lo = tl.maximum(kv_lo, (seq_len - 1) // chunk_size * chunk_size)
    seg = tl.cdiv(tl.cdiv(seq_len - kv_lo, num_splits), BLOCK_N) * BLOCK_N
    start = kv_lo + split * seg
    end = tl.minimum(start + seg, seq_len)

    rows = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_size
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(
        q_ptr + request.to(tl.int64) * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=io_mask,
        other=0.0,
    )
    if FP32:
        q = q.to(tl.float32)
    elif KEY_FORMAT == 0:
        q = q.to(cache_ptr.dtype.element_ty)
    else:
        q = q.to(tl.float16)  # a quantized cache's tiles are float16 scale units (exact)

    last = seq_len - 1  # the query's own position: the new token's K/V when STORE_NEW_KV
    if STORE_NEW_KV:
        # in the cache dtype, as store_kv writes it: the tile sees exactly what the cache would hold
        new_k = tl.load(
            new_k_ptr + request.to(tl.int64) * stride_new_k_token + kv_head * stride_new_k_head + dims,
            mask=dim_mask,
            other=0.0,
        ).to(cache_ptr.dtype.element_ty)
        new_v = tl.load(
            new_v_ptr + request.to(tl.int64) * stride_new_v_token + kv_head * stride_new_v_head + dims,
            mask=dim_mask,
            other=0.0,
        ).to(cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if USE_SINKS and not IS_SPLIT:  # split: the reduce kernel adds the sink once
        m_i = tl.load(sinks_ptr + head, mask=row_mask, other=-1.0e30).to(tl.float32) * 1.4426950408889634
        l_i += 1.0
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_row = block_table_ptr + request.to(tl.int64) * stride_table
    for tile in range(start, end, BLOCK_N):
        kv_pos = tile + tl.arange(0, BLOCK_N)
        kv_mask = kv_pos < end
        load_mask = kv_mask & (kv_pos != last) if STORE_NEW_KV else kv_mask  # the new row is not in the cache yet
        allowed = row_mask[:, None] & kv_mask[None, :]
        if KEY_FORMAT == 0:
            k, v = load_kv_tile(
                cache_ptr,
                table_row,
                kv_pos,
                load_mask,
                kv_head,
                dims,
                dim_mask,
                stride_cache_block,
                stride_cache_offset,
                stride_cache_head,
                stride_cache_kv,
                PAGE,
                FP32,
            )
            if STORE_NEW_KV:
                is_new = (kv_pos == last)[:, None]
                k = tl.where(is_new, new_k[None, :].to(k.dtype), k)
                v = tl.where(is_new, new_v[None, :].to(v.dtype), v)
            acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, allowed, sm_scale, soft_cap, USE_SOFT_CAP, FP32)
        else:  # float16 units, the row scales applied to scores and probabilities
            k, v, key_scale, value_scale = load_quant_units_tile(
                cache_ptr,
                scales_ptr,
                table_row,
                kv_pos,
                load_mask,
                kv_head,
                dims,
                dim_mask,
                stride_cache_block,
                stride_cache_offset,
                stride_cache_head,
                stride_scales_block,
                stride_scales_offset,
                stride_scales_head,
                PAGE,
                KEY_FORMAT,
                VALUE_FORMAT,
                KEY_BYTES,
                VALUE_BYTES,
            )
            if FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            acc, m_i, l_i = scaled_softmax_step(
                acc, m_i, l_i, q, k, v, key_scale, value_scale, allowed, sm_scale, soft_cap, USE_SOFT_CAP, FP32
            )
    if KEY_FORMAT != 0:
        acc = acc * (1.0 / SCALED_P_BOOST)

    if STORE_NEW_KV:
        # exactly one split's segment [start, end) holds seq_len - 1; negative slots are padding
        slot = tl.load(slot_mapping_ptr + request).to(tl.int64)
        is_owner = (start <= last) & (last < end) & (slot >= 0)
        dst = cache_ptr + (slot // PAGE) * stride_cache_block + (slot % PAGE) * stride_cache_offset
        dst += kv_head * stride_cache_head + dims
        store_mask = tl.where(is_owner, dim_mask, False)  # not `dim_mask & is_owner`: the interpreter rejects it
        tl.store(dst, new_k, mask=store_mask)
        tl.store(dst + stride_cache_kv, new_v, mask=store_mask)

    if not IS_SPLIT:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + request.to(tl.int64) * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )
    else:
        # partials: acc [R, H, S, BLOCK_D], (m, l) [R, H, S, 2]
        part = (request.to(tl.int64) * num_heads + head) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], acc, mask=row_mask[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_mask)


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    sinks_ptr,
    signs_ptr,
    rotation_ptr,
    stride_out_token,
    stride_out_head,
    head_size,
    num_heads,
    num_splits,
    SPLITS_P2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_SINKS: tl.constexpr,
    UNROTATE: tl.constexpr,
    GROUP: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)
    split_mask = splits < num_splits
    part = (request.to(tl.int64) * num_heads + head) * num_splits + splits
    m = tl.load(part_ml_ptr + part * 2, mask=split_mask, other=-1.0e30)
    partial_sum = tl.load(part_ml_ptr + part * 2 + 1, mask=split_mask, other=0.0)
    top = tl.max(m, 0)
    if USE_SINKS:  # one more term of the denominator, with no value
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    weight = tl.exp2(m - top)
    total = tl.sum(weight * partial_sum, 0)
    if USE_SINKS:
        total += tl.exp2(sink - top)
    dims = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], mask=split_mask[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    if UNROTATE:  # kv_quant.unrotate: out @ W, then the KV head's sign flips
        inner = tl.arange(0, BLOCK_D)
        rotation_mask = (inner < head_size)[:, None] & (dims < head_size)[None, :]
        rotation = tl.load(rotation_ptr + inner[:, None] * head_size + dims[None, :], mask=rotation_mask, other=0.0)
        out = tl.sum(tl.reshape(out, (BLOCK_D, 1)) * rotation, 0)
        out = out * tl.load(signs_ptr + (head // GROUP) * head_size + dims, mask=dims < head_size, other=0.0)
    tl.store(
        out_ptr + request.to(tl.int64) * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_size,
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def num_kv_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, programs_per_sm: int = 2) -> int:
    """Splits per (request, KV head): enough programs for ``programs_per_sm`` per SM, each with
    >= MIN_SPLIT_TOKENS keys.

    Depends on host ints only. For a CUDA graph captured once for all contexts, pass the model's
    maximum length as ``max_seq_len``: the split count then depends on the batch shape alone.
    """
    wanted = triton.cdiv(programs_per_sm * num_sms, max(1, num_reqs * num_kv_heads))
    useful = triton.cdiv(max(max_seq_len, 1), MIN_SPLIT_TOKENS)
    return max(1, min(wanted, useful, MAX_SPLITS))


def decode_tiles(key_format: int, head_size: int) -> tuple[int, int, int]:
    """Default ``(block_n, num_warps, programs per SM)`` of a decode over a cache whose key format
    code is ``key_format`` (0: model dtype); heads over 128 take half the keys per tile."""
    block_n, num_warps, programs_per_sm = QUANT_DECODE_TILES.get(key_format, MODEL_DTYPE_TILES)
    return (block_n if head_size <= 128 else block_n // 2), num_warps, programs_per_sm


def _check_new_kv(
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    num_reqs: int,
    num_kv_heads: int,
    head_size: int,
) -> bool:
    """Whether the fused store is asked for; its arguments come all three or not at all (shapes only: no sync)."""
    given = [x is not None for x in (key, value, slot_mapping)]
    if not any(given):
        return False
    if not all(given):
        raise ValueError("decode_attention stores the new K/V only with all of key, value and slot_mapping")
    for name, rows in (("key", key), ("value", value)):
        if rows.shape[0] < num_reqs or tuple(rows.shape[1:]) != (num_kv_heads, head_size) or rows.stride(-1) != 1:
            raise ValueError(
                f"{name} must be [>= {num_reqs} requests, {num_kv_heads}, {head_size}] with a contiguous "
                f"last dim (one new token per request), got {tuple(rows.shape)} strides {rows.stride()}"
            )
    if slot_mapping.shape[0] < num_reqs:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {num_reqs} requests")
    return True


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor | KVCache,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_reqs: int,
    max_seq_len: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_splits: int | None = None,
    num_sms: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    out: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    fp32_math: bool | None = None,
    output_signs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per request (``query`` ``[R, H, D]``) over the paged cache.

    ``num_splits`` defaults to :func:`num_kv_splits`; ``block_n``/``num_warps``/``num_stages`` tune
    the tiles (the defaults, :data:`MODEL_DTYPE_TILES` and :data:`QUANT_DECODE_TILES` by the cache's
    key format, suit an H200: bf16 64 keys × head 128 per tile, 4 warps, 2 stages).

    With ``key``/``value`` (``[R, H_kv, D]``, last dim contiguous: the step's new token of each
    request) and ``slot_mapping`` (``[R]``), the kernel also does ``store_kv``'s work for the step:
    position ``seq_len - 1`` of request ``r`` attends to ``key[r]``/``value[r]``, which are written
    to ``kv_cache`` at ``slot_mapping[r]`` (skipped for negative slots; ``seq_lens >= 1``, the new
    token counted, as in every decode step and CUDA-graph padding row). The cache then holds what
    ``store_kv`` followed by this function without them would leave, and the output is the same.
    Without them the cache is only read, and position ``seq_len - 1`` must be stored already.
    ``sinks`` ``[H]``: per-head sink logits (see ``AttentionBackend.forward``). ``chunk_size``:
    chunked local attention (Llama 4), keys from the start of the query's chunk only.
    ``fp32_math``: float32 tiles and dots (default: for a float32 query, and always under the
    interpreter); False lets a float32 query (a turbo dtype's rotated query, as it comes from the
    rotation) run the tensor-core path of a bf16 model. ``out`` may be float32 either way.
    ``output_signs`` (``[H_kv, D]`` float32, a cache whose values are rotated): the output is
    rotated back (:func:`framework.kv_quant.unrotate`) in the reduce kernel, which then always runs.

    ``kv_cache`` may be a quantized :class:`~framework.kv_cache.KVCache`: tiles are then read from
    its packed rows (:mod:`fw_triton_attention.quant_tiles`; the query rotated by the caller for
    rotated-key dtypes), and the fused store is not available (store with ``quant_store`` first).
    """
    _, num_heads, head_size = query.shape
    cache = cache_geometry(kv_cache)
    num_kv_heads = cache.num_kv_heads
    store_new_kv = _check_new_kv(key, value, slot_mapping, num_reqs, num_kv_heads, head_size)
    if store_new_kv and cache.constexprs["KEY_FORMAT"]:
        raise ValueError("decode_attention cannot fuse the store into a quantized cache; store with quant_store first")
    group = num_heads // num_kv_heads
    out = torch.empty_like(query) if out is None else out
    if num_reqs == 0:
        return out
    if sliding_window:
        max_seq_len = min(max_seq_len, sliding_window)
    if chunk_size:
        max_seq_len = min(max_seq_len, chunk_size)
    tile_n, tile_warps, programs_per_sm = decode_tiles(cache.constexprs["KEY_FORMAT"], head_size)
    if num_splits is None:
        num_sms = num_sms or _num_sms(query.device)
        num_splits = num_kv_splits(num_reqs, num_kv_heads, max_seq_len, num_sms, programs_per_sm)
    block_d = max(16, triton.next_power_of_2(head_size))
    block_n = block_n or tile_n
    num_warps = num_warps or tile_warps
    reduce = num_splits > 1 or output_signs is not None
    if reduce:
        part_acc = torch.empty(num_reqs, num_heads, num_splits, block_d, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(num_reqs, num_heads, num_splits, 2, dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused
    if store_new_kv:
        new_kv_strides = (key.stride(0), key.stride(1), value.stride(0), value.stride(1))
    else:
        key = value = slot_mapping = seq_lens  # unused
        new_kv_strides = (0, 0, 0, 0)
    _decode_attention_kernel[(num_reqs, num_kv_heads, num_splits)](
        query,
        cache.data,
        out,
        part_acc,
        part_ml,
        seq_lens,
        block_table,
        key,
        value,
        slot_mapping,
        seq_lens if sinks is None else sinks,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *cache.strides,
        cache.scales,
        *cache.scale_strides,
        block_table.stride(0),
        *new_kv_strides,
        sm_scale,
        soft_cap or 1.0,
        sliding_window or 0,
        chunk_size or 1,
        head_size,
        num_heads,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        PAGE=cache.page,
        IS_SPLIT=reduce,
        STORE_NEW_KV=store_new_kv,
        USE_WINDOW=bool(sliding_window),
        USE_CHUNK=bool(chunk_size),
        USE_SOFT_CAP=bool(soft_cap),
        USE_SINKS=sinks is not None,
        FP32=INTERPRET or (query.dtype == torch.float32 if fp32_math is None else fp32_math),
        **cache.constexprs,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if reduce:
        unrotate = output_signs is not None
        _decode_reduce_kernel[(num_reqs, num_heads)](
            part_acc,
            part_ml,
            out,
            seq_lens if sinks is None else sinks,
            output_signs if unrotate else part_ml,
            kv_quant.hadamard(head_size, query.device) if unrotate else part_ml,
            out.stride(0),
            out.stride(1),
            head_size,
            num_heads,
            num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            USE_SINKS=sinks is not None,
            UNROTATE=unrotate,
            GROUP=group,
            num_warps=8 if unrotate else 4,
        )
    return out
