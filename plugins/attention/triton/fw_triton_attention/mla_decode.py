"""Multi-head latent attention (``"mla"`` KV layout): the latent store and the split-KV decode.

An MLA cache row is one vector per token shared by every head (``L = kv_lora_rank``,
``R = qk_rope_head_dim``)::

    cache [num_blocks, PAGE, L + R]     row = [ c_kv (L: keys' first part and the values) | k_pe (R) ]
    query [T, H, L + R]                 per head [ q_nope @ W_UK (L) | q_pe (R) ]
    out   [T, H, L]  = softmax((q_lat . c_kv + q_pe . k_pe) * scale) @ c_kv

Decode grid ``(request, head_block, split)``: a program holds ``BLOCK_H`` heads of one request as
the rows of its tiles, so each latent tile it loads serves all of them (DeepSeek-V2-Lite's 16 heads
are one head block: the latent is read once per split). The context is split as in
:mod:`fw_triton_attention.decode` (segment length computed in the kernel, split count from host
ints only, partials combined by its reduce kernel), so a captured CUDA graph stays valid as
contexts grow.

Fused store (``latent``/``slot_mapping`` given): request ``r``'s new latent is row ``r`` and sits at
position ``seq_len - 1``; every program takes it from the row instead of the cache, and the program
of head block 0 whose segment holds it writes it at ``slot_mapping[r]`` (negative: padding, nothing
written). No program reads that slot, so there is no race and no separate store launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fw_triton_attention.decode import _decode_reduce_kernel, _num_sms, num_kv_splits
from fw_triton_attention.tile_math import INTERPRET, fold_scores, latent_scores, load_latent_tile


@triton.jit
def _store_latent_kernel(
    latent_ptr,
    cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_latent_token,
    stride_cache_block,
    stride_cache_offset,
    latent_size,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    features = tl.arange(0, BLOCK_E)
    mask = (slots >= 0)[:, None] & (features < latent_size)[None, :]
    rows = tl.load(latent_ptr + tokens[:, None] * stride_latent_token + features[None, :], mask=mask)
    dst = cache_ptr + ((slots // PAGE) * stride_cache_block + (slots % PAGE) * stride_cache_offset)[:, None]
    tl.store(dst + features[None, :], rows.to(cache_ptr.dtype.element_ty), mask=mask)


def store_latent(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``latent`` ``[T, L + R]`` (last dim contiguous) into the ``"mla"`` cache at ``slot_mapping[:T]``
    (negative slots: padding, skipped)."""
    num_tokens, latent_size = latent.shape
    if num_tokens == 0:
        return
    assert latent.stride(-1) == 1 and kv_cache.stride(-1) == 1 and kv_cache.shape[-1] == latent_size
    block_e = triton.next_power_of_2(latent_size)
    block_t = min(max(1, (16384 if INTERPRET else 4096) // block_e), triton.next_power_of_2(num_tokens))
    _store_latent_kernel[(triton.cdiv(num_tokens, block_t),)](
        latent,
        kv_cache,
        slot_mapping,
        num_tokens,
        latent.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        latent_size,
        PAGE=kv_cache.shape[1],
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        num_warps=4,
    )


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    seq_lens_ptr,
    block_table_ptr,
    new_ptr,
    slot_mapping_ptr,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_offset,
    stride_table,
    stride_new_token,
    sm_scale,
    num_heads,
    rank,
    rope,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    STORE_NEW: tl.constexpr,
    FP32: tl.constexpr,
):
    request = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + request)
    seg = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * seg
    end = tl.minimum(start + seg, seq_len)

    head = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = head < num_heads
    lat = tl.arange(0, BLOCK_L)
    lat_mask = lat < rank
    rot = tl.arange(0, BLOCK_R)
    rot_mask = rot < rope
    q_rows = q_ptr + request.to(tl.int64) * stride_q_token + head[:, None] * stride_q_head
    q_lat = tl.load(q_rows + lat[None, :], mask=head_mask[:, None] & lat_mask[None, :], other=0.0)
    q_rot = tl.load(q_rows + rank + rot[None, :], mask=head_mask[:, None] & rot_mask[None, :], other=0.0)
    if FP32:
        q_lat = q_lat.to(tl.float32)
        q_rot = q_rot.to(tl.float32)
    else:
        q_lat = q_lat.to(cache_ptr.dtype.element_ty)
        q_rot = q_rot.to(cache_ptr.dtype.element_ty)

    last = seq_len - 1  # the query's own position: the new latent when STORE_NEW
    if STORE_NEW:  # in the cache dtype, as store_latent writes it
        new_row = new_ptr + request.to(tl.int64) * stride_new_token
        new_lat = tl.load(new_row + lat, mask=lat_mask, other=0.0).to(cache_ptr.dtype.element_ty)
        new_rot = tl.load(new_row + rank + rot, mask=rot_mask, other=0.0).to(cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    table_row = block_table_ptr + request.to(tl.int64) * stride_table
    for tile in range(start, end, BLOCK_N):
        kv_pos = tile + tl.arange(0, BLOCK_N)
        kv_mask = kv_pos < end
        load_mask = kv_mask & (kv_pos != last) if STORE_NEW else kv_mask  # the new row is not in the cache yet
        c_kv, k_pe = load_latent_tile(
            cache_ptr,
            table_row,
            kv_pos,
            load_mask,
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
        if STORE_NEW:
            is_new = (kv_pos == last)[:, None]
            c_kv = tl.where(is_new, new_lat[None, :].to(c_kv.dtype), c_kv)
            k_pe = tl.where(is_new, new_rot[None, :].to(k_pe.dtype), k_pe)
        scores = latent_scores(q_lat, q_rot, c_kv, k_pe, sm_scale, FP32)
        allowed = head_mask[:, None] & kv_mask[None, :]
        acc, m_i, l_i = fold_scores(acc, m_i, l_i, scores, c_kv, allowed, FP32)

    if STORE_NEW:
        # exactly one split's segment [start, end) holds seq_len - 1; head block 0 writes it
        slot = tl.load(slot_mapping_ptr + request).to(tl.int64)
        is_owner = (head_block == 0) & (start <= last) & (last < end) & (slot >= 0)
        dst = cache_ptr + (slot // PAGE) * stride_cache_block + (slot % PAGE) * stride_cache_offset
        tl.store(dst + lat, new_lat, mask=tl.where(is_owner, lat_mask, False))  # the interpreter rejects `mask & bool`
        tl.store(dst + rank + rot, new_rot, mask=tl.where(is_owner, rot_mask, False))

    if not IS_SPLIT:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        out_rows = out_ptr + request.to(tl.int64) * stride_out_token + head[:, None] * stride_out_head
        tl.store(out_rows + lat[None, :], out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & lat_mask[None, :])
    else:
        # partials as decode.py's reduce reads them: acc [R, H, S, BLOCK_L], (m, l) [R, H, S, 2]
        part = (request.to(tl.int64) * num_heads + head) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * BLOCK_L + lat[None, :], acc, mask=head_mask[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=head_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=head_mask)


def mla_decode_tiles(rank: int) -> tuple[int, int, int, int]:
    """``(BLOCK_H, BLOCK_N, num_warps, num_stages)`` of the decode kernel: 16 heads per program (the
    smallest tensor-core tile), 32 latents of 512 per tile (64 for smaller ranks; 128 interpreted)."""
    block_n = 128 if INTERPRET else (32 if rank >= 256 else 64)
    return 16, block_n, 4, 2


def mla_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    rank: int,
    num_reqs: int,
    max_seq_len: int,
    sm_scale: float,
    num_splits: int | None = None,
    num_sms: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    latent: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA of one absorbed query per request (``query`` ``[R, H, L + R]``) over the ``"mla"`` cache
    ``[num_blocks, PAGE, L + R]``; returns ``[R, H, L]`` (``L = rank``).

    ``num_splits`` defaults to :func:`~fw_triton_attention.decode.num_kv_splits` over the head blocks;
    ``block_n`` / ``num_warps`` / ``num_stages`` override :func:`mla_decode_tiles` (for tuning).
    With ``latent`` (``[R, L + R]``, last dim contiguous: each request's new token) and
    ``slot_mapping`` the kernel also stores the new latents, as :func:`store_latent` would first
    (``seq_lens >= 1``, the new token counted); without them the cache is only read. Grids come
    from host ints: no host sync, CUDA-graph safe.
    """
    _, num_heads, latent_size = query.shape
    rope = latent_size - rank
    if (latent is None) != (slot_mapping is None):
        raise ValueError("mla_decode stores the new latents only with both latent and slot_mapping")
    if latent is not None and (latent.shape[0] < num_reqs or latent.shape[1] != latent_size or latent.stride(-1) != 1):
        raise ValueError(
            f"latent must be [>= {num_reqs} requests, {latent_size}] with a contiguous last dim, "
            f"got {tuple(latent.shape)} strides {latent.stride()}"
        )
    out = query.new_empty(query.shape[0], num_heads, rank) if out is None else out
    if num_reqs == 0:
        return out
    block_h, default_n, default_warps, default_stages = mla_decode_tiles(rank)
    block_n, num_warps, num_stages = block_n or default_n, num_warps or default_warps, num_stages or default_stages
    num_head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = num_kv_splits(num_reqs, num_head_blocks, max_seq_len, num_sms or _num_sms(query.device))
    block_l, block_r = max(16, triton.next_power_of_2(rank)), max(16, triton.next_power_of_2(rope))
    if num_splits > 1:
        part_acc = torch.empty(num_reqs, num_heads, num_splits, block_l, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(num_reqs, num_heads, num_splits, 2, dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused
    store_new = latent is not None
    new, slots, stride_new = (latent, slot_mapping, latent.stride(0)) if store_new else (seq_lens, seq_lens, 0)
    _mla_decode_kernel[(num_reqs, num_head_blocks, num_splits)](
        query,
        kv_cache,
        out,
        part_acc,
        part_ml,
        seq_lens,
        block_table,
        new,
        slots,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        stride_new,
        sm_scale,
        num_heads,
        rank,
        rope,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_L=block_l,
        BLOCK_R=block_r,
        PAGE=kv_cache.shape[1],
        IS_SPLIT=num_splits > 1,
        STORE_NEW=store_new,
        FP32=INTERPRET or query.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_reqs, num_heads)](
            part_acc,
            part_ml,
            out,
            seq_lens,  # no sinks
            part_ml,  # no rotation: signs and rotation unused
            part_ml,
            out.stride(0),
            out.stride(1),
            rank,
            num_heads,
            num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits),
            BLOCK_D=block_l,
            USE_SINKS=False,
            UNROTATE=False,
            GROUP=1,
            num_warps=4,
        )
    return out
