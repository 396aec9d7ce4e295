"""Quantized KV caches in Triton: store rows (``quant_store``) and load dequantized K/V tiles.

The layout and the codes are :mod:`framework.kv_cache`'s (the torch reference is
:mod:`framework.kv_quant`): per token and KV head one uint8 row, key codes then value codes, and
two log-coded scale bytes beside it. Formats are constexpr codes: ``8`` fp8 e4m3, ``4`` int4 (two
per byte, even dim low), ``3`` int3 (dim ``d`` at bits ``3d..3d+2`` of the row's byte stream).

A tile load reads each position's page once, loads the row's bytes (fp8 and int4: one contiguous,
vectorised run per row, an int4 byte split into its two nibbles; int3 dims gather the bytes they
straddle), turns codes into scale units and multiplies by the row's scale, so the attention kernels run their usual online softmax on the tiles. The query is
rotated by the caller for rotated-key dtypes (scores are taken in the rotated space).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from framework.kv_cache import KVCache
from fw_triton_attention.tile_math import INTERPRET, load_kv_tile

#: the constexpr code of each row format (``model``: not quantized)
FORMAT_CODES = {"model": 0, "fp8": 8, "int4": 4, "int3": 3}


@triton.jit
def decode_scale(code):
    """The float32 scale a log-coded byte means: ``2 ** ((code - 128) / 8)``."""
    return tl.exp2((code.to(tl.float32) - 128.0) * 0.125)


@triton.jit
def _row_units(row_ptrs, dims, kv_mask, tile_mask, FORMAT: tl.constexpr, ROW_BYTES: tl.constexpr):
    """Codes of ``dims`` of the rows at ``row_ptrs`` ``[N]`` as float16 scale units ``[N, BLOCK_D]``
    (exact: fp8 values and the half-integer units of int codes are all float16 numbers).

    fp8 and int4 rows are read as one contiguous run of bytes per row (row starts are 16-byte
    aligned: every row width is a multiple of 16 for head sizes that are, and Triton sees it from
    the strides), so the loads vectorise; an int4 byte is loaded once and split into its two
    nibbles, interleaved back into dim order. No float conversion for int4 (conversions issue at
    an eighth of the FMA rate, and they bounded the dequantizing decode): a nibble ``n`` or'ed
    into ``0x6400`` is the float16 ``1024 + n``. e4m3 -> float16 is one conversion per two values.
    Masked rows read finite units (callers mask their scores); dims past the row read 0."""
    BLOCK_D: tl.constexpr = dims.shape[0]
    if FORMAT == 8:
        if ROW_BYTES == BLOCK_D:  # no padded dims: the row mask alone (vector loads need no dim mask)
            raw = tl.load(row_ptrs[:, None] + dims[None, :], mask=kv_mask[:, None], other=0)
        else:
            raw = tl.load(row_ptrs[:, None] + dims[None, :], mask=tile_mask, other=0)
        units = raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    elif FORMAT == 4:
        pairs = tl.arange(0, BLOCK_D // 2)
        pair_ptrs = row_ptrs[:, None] + pairs[None, :]
        if ROW_BYTES * 2 == BLOCK_D:
            raw = tl.load(pair_ptrs, mask=kv_mask[:, None], other=0)
        else:
            raw = tl.load(pair_ptrs, mask=kv_mask[:, None] & (pairs < ROW_BYTES)[None, :], other=0)
        raw = raw.to(tl.int16)
        # byte j holds dim 2j (low nibble) and dim 2j + 1 (high): interleaving restores dim order
        low = ((raw & 15) | 0x6400).to(tl.float16, bitcast=True)
        high = (((raw >> 4) & 15) | 0x6400).to(tl.float16, bitcast=True)
        units = (tl.interleave(low, high) - 1032.0) + 0.5  # 1024 + n -> n - 7.5, exact in float16
        if ROW_BYTES * 2 != BLOCK_D:
            units = tl.where(tile_mask, units, 0.0)
    else:
        bit = dims * 3
        byte = bit // 8
        low = tl.load(row_ptrs[:, None] + byte[None, :], mask=tile_mask, other=0).to(tl.int32)
        high_mask = tile_mask & ((byte + 1) < ROW_BYTES)[None, :]
        high = tl.load(row_ptrs[:, None] + (byte + 1)[None, :], mask=high_mask, other=0).to(tl.int32)
        units = (((low | (high << 8)) >> (bit % 8)[None, :]) & 7).to(tl.float32) - 3.5
        units = tl.where(tile_mask, units, 0.0).to(tl.float16)
    return units


@triton.jit
def load_quant_units_tile(
    cache_ptr,
    scales_ptr,
    table_row,
    kv_pos,
    kv_mask,
    kv_head,
    dims,
    dim_mask,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_scales_block,
    stride_scales_offset,
    stride_scales_head,
    PAGE: tl.constexpr,
    KEY_FORMAT: tl.constexpr,
    VALUE_FORMAT: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
):
    """Keys and values ``[BLOCK_N, BLOCK_D]`` of positions ``kv_pos`` in float16 scale units and
    their float32 scales ``[BLOCK_N]``: the decode kernel multiplies the scores by the key scales
    and the probabilities by the value scales instead of every element of the tiles."""
    page = tl.load(table_row + kv_pos // PAGE, mask=kv_mask, other=0).to(tl.int64)
    offset = kv_pos % PAGE
    rows = cache_ptr + page * stride_cache_block + offset * stride_cache_offset + kv_head * stride_cache_head
    scale_rows = scales_ptr + page * stride_scales_block + offset * stride_scales_offset + kv_head * stride_scales_head
    key_scale = decode_scale(tl.load(scale_rows, mask=kv_mask, other=0))
    value_scale = decode_scale(tl.load(scale_rows + 1, mask=kv_mask, other=0))
    tile_mask = kv_mask[:, None] & dim_mask[None, :]
    k = _row_units(rows, dims, kv_mask, tile_mask, KEY_FORMAT, KEY_BYTES)
    v = _row_units(rows + KEY_BYTES, dims, kv_mask, tile_mask, VALUE_FORMAT, VALUE_BYTES)
    return k, v, key_scale, value_scale


@triton.jit
def load_quant_kv_tile(
    cache_ptr,
    scales_ptr,
    table_row,
    kv_pos,
    kv_mask,
    kv_head,
    dims,
    dim_mask,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_scales_block,
    stride_scales_offset,
    stride_scales_head,
    PAGE: tl.constexpr,
    KEY_FORMAT: tl.constexpr,
    VALUE_FORMAT: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
):
    """Dequantized keys and values ``[BLOCK_N, BLOCK_D]`` (float32) of positions ``kv_pos`` of one
    sequence and KV head (masked rows read as 0)."""
    page = tl.load(table_row + kv_pos // PAGE, mask=kv_mask, other=0).to(tl.int64)
    offset = kv_pos % PAGE
    rows = cache_ptr + page * stride_cache_block + offset * stride_cache_offset + kv_head * stride_cache_head
    scale_rows = scales_ptr + page * stride_scales_block + offset * stride_scales_offset + kv_head * stride_scales_head
    key_scale = decode_scale(tl.load(scale_rows, mask=kv_mask, other=0))
    value_scale = decode_scale(tl.load(scale_rows + 1, mask=kv_mask, other=0))
    tile_mask = kv_mask[:, None] & dim_mask[None, :]
    k = _row_units(rows, dims, kv_mask, tile_mask, KEY_FORMAT, KEY_BYTES).to(tl.float32) * key_scale[:, None]
    v = _row_units(rows + KEY_BYTES, dims, kv_mask, tile_mask, VALUE_FORMAT, VALUE_BYTES).to(tl.float32)
    v = v * value_scale[:, None]
    return k, v


@triton.jit
def load_cache_tile(
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
    PAGE: tl.constexpr,
    FP32: tl.constexpr,
    KEY_FORMAT: tl.constexpr,
    VALUE_FORMAT: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
):
    """The K/V tile of the attention kernels from either cache: :func:`load_kv_tile` for a
    model-dtype cache (``KEY_FORMAT == 0``), else :func:`load_quant_kv_tile` in the query's dtype
    (float32 with ``FP32``)."""
    if KEY_FORMAT == 0:
        k, v = load_kv_tile(
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
            PAGE,
            FP32,
        )
    else:
        k, v = load_quant_kv_tile(
            cache_ptr,
            scales_ptr,
            table_row,
            kv_pos,
            kv_mask,
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
        if not FP32:
            k = k.to(q_ptr.dtype.element_ty)
            v = v.to(q_ptr.dtype.element_ty)
    return k, v


@triton.jit
def _round_to_e4m3(x):
    """``x`` (float32, ``|x| <= 448``) rounded to the nearest float8 e4m3 value, ties to even, as
    float32: what compiled conversions (and torch) store. The interpreter's own conversion rounds
    ties away from zero and loses the carry into the exponent, so it only gets exact values."""
    bits = x.to(tl.int32, bitcast=True)
    # keep 3 of fp32's 23 mantissa bits: add just under half a step, plus one if the kept lsb is odd
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # below 2^-6 e4m3 is subnormal, a fixed step of 2^-9: fp32 addition at 1.5 * 2^14 rounds to it
    subnormal = (tl.abs(x) + 24576.0) - 24576.0
    subnormal = tl.where(bits < 0, -subnormal, subnormal)  # the sign of -0.0 and of underflows kept
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _store_row(
    src,
    dst,
    scale_dst,
    static_ptr,
    HAS_STATIC: tl.constexpr,
    FORMAT: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Quantize one row of ``HEAD_SIZE`` elements at ``src`` into ``dst`` (its scale byte at ``scale_dst``)."""
    PER: tl.constexpr = 1 if FORMAT == 8 else (2 if FORMAT == 4 else 8)  # dims per packed group
    GROUP_BYTES: tl.constexpr = 1 if FORMAT == 8 else (1 if FORMAT == 4 else 3)
    NUM_GROUPS: tl.constexpr = HEAD_SIZE // PER
    GROUPS_P2: tl.constexpr = triton.next_power_of_2(NUM_GROUPS)
    HALF: tl.constexpr = 448.0 if FORMAT == 8 else (7.5 if FORMAT == 4 else 3.5)
    groups = tl.arange(0, GROUPS_P2)
    lanes = tl.arange(0, PER)
    group_mask = groups < NUM_GROUPS
    mask = group_mask[:, None] & (lanes[None, :] < PER)
    x = tl.load(src + groups[:, None] * PER + lanes[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_STATIC:
        scale = tl.load(static_ptr)
    else:
        # IEEE divisions here and below, as torch's (a plain `/` compiles to approximations, by a
        # constant to a multiply by an approximate reciprocal): an absmax of 1.75 * 2^k must give
        # torch's scale code for 2^(k - 8), not the next one up
        scale = tl.div_rn(tl.max(tl.max(tl.abs(x), 1), 0), HALF)
    code = tl.ceil(tl.log2(tl.maximum(scale, 1.52587890625e-05)) * 8.0) + 128.0  # 2^-16: code 0
    code = tl.minimum(tl.maximum(code, 0.0), 255.0)
    units = tl.div_rn(x, decode_scale(code))
    if FORMAT == 8:
        clamped = tl.minimum(tl.maximum(units, -448.0), 448.0)
        if INTERPRETED:  # the interpreter rounds ties away and drops carries: hand it exact e4m3 values
            clamped = _round_to_e4m3(clamped)
        stored = clamped.to(tl.float8e4nv)
        tl.store(dst + groups[:, None] + lanes[None, :], stored.to(tl.uint8, bitcast=True), mask=mask)
    else:
        codes = tl.minimum(tl.maximum(tl.floor(units + (HALF + 0.5)), 0.0), 2 * HALF).to(tl.int32)
        word = tl.sum(codes << (lanes * (3 if FORMAT == 3 else 4))[None, :], 1)  # [groups]: the packed bits
        for i in tl.static_range(GROUP_BYTES):
            tl.store(dst + groups * GROUP_BYTES + i, ((word >> (8 * i)) & 255).to(tl.uint8), mask=group_mask)
    tl.store(scale_dst, code.to(tl.uint8))


@triton.jit
def _quant_store_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    scales_ptr,
    slot_mapping_ptr,
    k_static_ptr,
    v_static_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_scales_block,
    stride_scales_offset,
    stride_scales_head,
    PAGE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    KEY_FORMAT: tl.constexpr,
    VALUE_FORMAT: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    HAS_K_STATIC: tl.constexpr,
    HAS_V_STATIC: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # negative: a padding row
        page, offset = slot // PAGE, slot % PAGE
        row = cache_ptr + page * stride_cache_block + offset * stride_cache_offset + head * stride_cache_head
        scale_row = scales_ptr + page * stride_scales_block + offset * stride_scales_offset + head * stride_scales_head
        key = key_ptr + token * stride_key_token + head * stride_key_head
        value = value_ptr + token * stride_value_token + head * stride_value_head
        _store_row(key, row, scale_row, k_static_ptr + head, HAS_K_STATIC, KEY_FORMAT, HEAD_SIZE, INTERPRETED)
        _store_row(
            value,
            row + KEY_BYTES,
            scale_row + 1,
            v_static_ptr + head,
            HAS_V_STATIC,
            VALUE_FORMAT,
            HEAD_SIZE,
            INTERPRETED,
        )


def quant_store(key: torch.Tensor, value: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Store ``key`` and ``value`` ``[T, H_kv, D]`` (last dim contiguous; already rotated where the
    dtype rotates them, and then float32 as :func:`framework.kv_quant.rotate` returns them) into the
    quantized ``cache`` at ``slot_mapping[:T]``, the bytes :func:`framework.kv_quant.store_quantized`
    stores; fp8 rows use the checkpoint scales if set."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    spec, data, scales = cache.spec, cache.data, cache.scales
    k_static = cache.k_scale if spec.key_format == "fp8" else None
    v_static = cache.v_scale if spec.value_format == "fp8" else None
    _quant_store_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        data,
        scales,
        slot_mapping,
        scales if k_static is None else k_static,
        scales if v_static is None else v_static,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        data.stride(0),
        data.stride(1),
        data.stride(2),
        scales.stride(0),
        scales.stride(1),
        scales.stride(2),
        PAGE=data.shape[1],
        HEAD_SIZE=head_size,
        KEY_FORMAT=FORMAT_CODES[spec.key_format],
        VALUE_FORMAT=FORMAT_CODES[spec.value_format],
        KEY_BYTES=key_bytes(cache),
        HAS_K_STATIC=k_static is not None,
        HAS_V_STATIC=v_static is not None,
        INTERPRETED=INTERPRET,
        num_warps=1,
    )


def key_bytes(cache: KVCache) -> int:
    """Bytes of the key part of a quantized row."""
    return (cache.spec.head_size * (8 if cache.spec.key_format == "fp8" else FORMAT_CODES[cache.spec.key_format])) // 8


def quant_kernel_args(cache: KVCache | None) -> dict:
    """The constexpr and stride arguments the attention kernels take for ``cache`` (``None``: a
    model-dtype cache, no quantized reads)."""
    if cache is None or not cache.is_quantized:
        return dict(KEY_FORMAT=0, VALUE_FORMAT=0, KEY_BYTES=0, VALUE_BYTES=0)
    width = cache.data.shape[-1]
    return dict(
        KEY_FORMAT=FORMAT_CODES[cache.spec.key_format],
        VALUE_FORMAT=FORMAT_CODES[cache.spec.value_format],
        KEY_BYTES=key_bytes(cache),
        VALUE_BYTES=width - key_bytes(cache),
    )


class CacheGeometry(NamedTuple):
    """How the attention kernels address a cache: its tensors, sizes, element strides and constexprs."""

    data: torch.Tensor
    scales: torch.Tensor  # the data tensor again for a model-dtype cache (unused)
    num_kv_heads: int
    page: int
    strides: tuple[int, int, int, int]  # key -> value, block, offset (token), head
    scale_strides: tuple[int, int, int]  # block, offset, head
    constexprs: dict


def cache_geometry(kv_cache: torch.Tensor | KVCache) -> CacheGeometry:
    """The :class:`CacheGeometry` of a model-dtype cache tensor ``[2, blocks, page, H_kv, D]`` (or
    its :class:`KVCache`) or of a quantized cache (the value codes start ``key_bytes`` into a row)."""
    if isinstance(kv_cache, KVCache) and kv_cache.is_quantized:
        data, scales = kv_cache.data, kv_cache.scales
        return CacheGeometry(
            data,
            scales,
            data.shape[2],
            data.shape[1],
            (key_bytes(kv_cache), data.stride(0), data.stride(1), data.stride(2)),
            (scales.stride(0), scales.stride(1), scales.stride(2)),
            quant_kernel_args(kv_cache),
        )
    data = kv_cache.data if isinstance(kv_cache, KVCache) else kv_cache
    strides = (data.stride(0), data.stride(1), data.stride(2), data.stride(3))
    return CacheGeometry(data, data, data.shape[3], data.shape[2], strides, (0, 0, 0), quant_kernel_args(None))
