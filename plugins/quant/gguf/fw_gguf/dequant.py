"""Dequantize GGUF (ggml) blocks with torch ops, on whatever device the bytes live.

Every function here reproduces gguf-py's numpy reference (`gguf.quants.dequantize`) bit for bit:
fp16 scales are widened to fp32 first and the arithmetic runs in fp32 in the same order, one
rounding per numpy operation (so no `addcmul`/FMA, which would round once where numpy rounds twice).

A quantized row of `n` values is `n / block_size` blocks of `type_size` bytes. The per-type
functions take `blocks` as a uint8 tensor `[num_blocks, type_size]` and return fp32
`[num_blocks, block_size]`; `DEQUANTIZE_BLOCKS` maps each type to its function so a fused kernel
(Triton, later) can replace one type without touching the rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

Q = GGMLQuantizationType

# Bound on fp32 elements produced per step, so a 262k-row embedding does not need several
# full-size fp32 temporaries at once.
_MAX_CHUNK_ELEMENTS = 1 << 22


class UnsupportedQuantTypeError(ValueError):
    """A GGUF tensor uses a ggml type fw cannot dequantize (IQ1-3, TQ*, NVFP4, integer types...)."""


def _shifts(count: int, step: int, device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
    """``0, step, 2*step, ...`` (``count`` values) as uint8 of ``shape``, made on ``device`` by a kernel:
    no host-to-device copy, so it is safe inside CUDA-graph capture."""
    return torch.arange(0, count * step, step, dtype=torch.uint8, device=device).reshape(shape)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scalar at byte `start` of every block, widened to fp32: `[num_blocks, 1]`."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`[n, k]` bytes -> `[n, 2k]`: all low nibbles, then all high nibbles (ggml's 4-bit order)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """`[n, k]` bytes -> `[n, 8k]` single bits, little-endian (bit j of a uint32 is element j)."""
    shifts = _shifts(8, 1, packed.device, (1, 1, 8))
    return ((packed.unsqueeze(-1) >> shifts) & 1).reshape(packed.shape[0], -1)


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _f16_values(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).to(torch.float32)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    # the bits shifted into the top half, exactly as gguf-py does (no NaN canonicalisation)
    return (blocks.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return d * q.to(torch.float32)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:]).to(torch.float32)
    return d * q + m


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    high = _bits(blocks[:, 2:6])
    q = (_nibbles(blocks[:, 6:]) | (high << 4)).to(torch.int8) - 16
    return d * q.to(torch.float32)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    high = _bits(blocks[:, 4:8])
    q = (_nibbles(blocks[:, 8:]) | (high << 4)).to(torch.float32)
    return d * q + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return blocks[:, 2:].view(torch.int8).to(torch.float32) * d


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # | scales 16 | qs 64 | d 2 | dmin 2 |  -- 16 groups of 16 values, 2 bits each
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    shifts = _shifts(4, 2, blocks.device, (1, 1, 4, 1))
    q = ((qs.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # | hmask 32 | qs 64 | scales 12 | d 2 |  -- 16 groups of 16, 6-bit signed scales:
    # low nibbles in bytes 0..7 (all low halves, then all high halves), top 2 bits in bytes 8..11
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks, 108)
    low = (scales[:, :8].reshape(n, 1, 8) >> _shifts(2, 4, blocks.device, (1, 2, 1))).reshape(n, 16)
    high = (scales[:, 8:].reshape(n, 1, 4) >> _shifts(4, 2, blocks.device, (1, 4, 1))).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * sc.to(torch.float32)).reshape(n, 16, 1)
    ql = (qs.reshape(n, 2, 1, 32) >> _shifts(4, 2, blocks.device, (1, 1, 4, 1))).reshape(n, 16, 16) & 3
    hm = (hmask.reshape(n, 1, 1, 32) >> _shifts(8, 1, blocks.device, (1, 1, 8, 1))).reshape(n, 16, 16)
    # a clear mask bit means "subtract 4"
    q = ql.to(torch.int8) - (((hm & 1) ^ 1) << 2).to(torch.int8)
    return (dl * q.to(torch.float32)).reshape(n, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins, as fp32 `[n, 8]`.

    bytes 0-3: scale 0-3 (low 6 bits), bytes 4-7: min 0-3 (low 6 bits), bytes 8-11: low nibble
    scale 4-7, high nibble min 4-7; the top 2 bits of bytes 0-7 complete scale/min 4-7.
    """
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # | d 2 | dmin 2 | scales 12 | qs 128 |  -- 8 groups of 32
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl = (d * sc).reshape(n, 8, 1)
    ml = (dmin * mn).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 16:].reshape(n * 4, 32)).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # | d 2 | dmin 2 | scales 12 | qh 32 | qs 128 |  -- bit plane j of qh is the 5th bit of group j
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl = (d * sc).reshape(n, 8, 1)
    ml = (dmin * mn).reshape(n, 8, 1)
    ql = _nibbles(blocks[:, 48:].reshape(n * 4, 32)).reshape(n, 8, 32)
    qh = (blocks[:, 16:48].reshape(n, 1, 32) >> _shifts(8, 1, blocks.device, (1, 8, 1))) & 1
    q = (ql | (qh << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # | ql 128 | qh 64 | scales 16 (int8) | d 2 |  -- 16 groups of 16
    n = blocks.shape[0]
    ql, qh, scales = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208]
    d = _f16(blocks, 208)
    dl = (d * scales.view(torch.int8).to(torch.float32)).reshape(n, 16, 1)
    low = _nibbles(ql.reshape(n * 2, 64)).reshape(n, 8, 32)
    high = ((qh.reshape(n, 2, 1, 32) >> _shifts(4, 2, blocks.device, (1, 1, 4, 1))) & 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


#: IQ4_NL / IQ4_XS's 16 non-linear levels (ggml's ``kvalues_iq4nl``).
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


#: IQ4_LEVELS as int8 bytes packed little-endian into four 32-bit words (levels 0-3, 4-7, ...).
IQ4_LEVEL_WORDS = tuple(
    int.from_bytes(bytes(level & 0xFF for level in IQ4_LEVELS[i : i + 4]), "little") for i in range(0, 16, 4)
)


def _iq4_levels(nibbles: torch.Tensor) -> torch.Tensor:
    """4-bit indices -> their IQ4 level as fp32, picked out of IQ4_LEVEL_WORDS by shifts: no table
    tensor to copy to the device (graph-safe), a few elementwise kernels."""
    n = nibbles.to(torch.int64)
    w0, w1, w2, w3 = IQ4_LEVEL_WORDS
    word = torch.where(n < 8, torch.where(n < 4, w0, w1), torch.where(n < 12, w2, w3))
    byte = (word >> ((n & 3) * 8)) & 0xFF
    return ((byte ^ 0x80) - 0x80).to(torch.float32)


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    # | d 2 | qs 16 |  -- like Q4_0, but each nibble indexes IQ4_LEVELS
    d = _f16(blocks, 0)
    return d * _iq4_levels(_nibbles(blocks[:, 2:]))


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # | d 2 | scales_h 2 (uint16: 2 bits per group) | scales_l 4 (a nibble per group) | qs 128 |
    # 8 groups of 32; group g's 16 bytes hold its low halves' nibbles then its high halves'
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    high = blocks[:, 2:4].contiguous().view(torch.int16).to(torch.int32)  # [n, 1]
    high = (high >> (2 * torch.arange(8, dtype=torch.int32, device=blocks.device))) & 3
    low = _nibbles(blocks[:, 4:8]).reshape(n, 2, 4).transpose(1, 2).reshape(n, 8).to(torch.int32)
    scales = (low | (high << 4)) - 32
    dl = (d * scales.to(torch.float32)).reshape(n, 8, 1)
    q = _iq4_levels(_nibbles(blocks[:, 8:].reshape(n * 8, 16))).reshape(n, 8, 32)
    return (dl * q).reshape(n, QK_K)


def e8m0_half(exponents: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes ``e`` -> ``2^(e - 128)`` as fp32 (ggml's ``ggml_e8m0_to_fp32_half``): the fp32 whose
    exponent field is ``e - 1``; for ``e < 2`` the subnormal ``0x00200000 << e``. Exact for every byte
    (255 gives ``2^127``: ggml has no NaN scale)."""
    e = exponents.to(torch.int32)
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def mxfp4_doubled_values(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (0..15) -> twice their value as int32 (ggml's ``kvalues_mxfp4``: 0, 1, 2, 3, 4, 6,
    8, 12, then the negatives; code 8 is +0), computed from the code's bits, no table::

        code = sign | exponent (2 bits) | mantissa (1 bit)
        2 * value = exponent ? (2 + mantissa) << (exponent - 1) : mantissa
    """
    codes = codes.to(torch.int32)
    exponent, mantissa = (codes >> 1) & 3, codes & 1
    magnitude = torch.where(exponent == 0, mantissa, (2 + mantissa) << (exponent - 1).clamp(min=0))
    return magnitude * (1 - ((codes >> 2) & 2))  # sign bit 3 -> factor -1


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # | e 1 | qs 16 |  -- 32 e2m1 codes: value i in the low nibble of qs[i], value 16 + i in its high
    # nibble (ggml's 4-bit order); ggml multiplies the doubled values by half the scale, 2^(e - 128)
    d = e8m0_half(blocks[:, :1])
    return d * mxfp4_doubled_values(_nibbles(blocks[:, 1:])).to(torch.float32)


DEQUANTIZE_BLOCKS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: _f32,
    Q.F16: _f16_values,
    Q.BF16: _bf16,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.IQ4_NL: _iq4_nl,
    Q.IQ4_XS: _iq4_xs,
    Q.MXFP4: _mxfp4,
}
"""Per-type block dequantizers: uint8 `[num_blocks, type_size]` -> fp32 `[num_blocks, block_size]`."""

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(DEQUANTIZE_BLOCKS)


def _supported_names() -> str:
    return ", ".join(t.name for t in DEQUANTIZE_BLOCKS)


def as_quant_type(qtype: int | GGMLQuantizationType) -> GGMLQuantizationType:
    """Return `qtype` as a supported `GGMLQuantizationType`.

    Raises `UnsupportedQuantTypeError` naming the type (or its id, when ggml has no such type)
    and listing the supported ones.
    """
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise UnsupportedQuantTypeError(
            f"GGUF quant type id {qtype!r} is unknown to this gguf library; supported: {_supported_names()}"
        ) from None
    if qtype not in DEQUANTIZE_BLOCKS:
        raise UnsupportedQuantTypeError(
            f"GGUF quant type {qtype.name} is not supported by fw; supported: {_supported_names()}"
        )
    return qtype


def bytes_per_row(qtype: int | GGMLQuantizationType, n_cols: int) -> int:
    """Bytes that `n_cols` values of `qtype` occupy (one packed row).

    Works for every ggml type in `gguf.GGML_QUANT_SIZES`, supported or not. Raises `ValueError`
    when `n_cols` is not a whole number of blocks.
    """
    qtype = GGMLQuantizationType(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if n_cols % block_size:
        raise ValueError(f"a {qtype.name} row needs a multiple of {block_size} values, got {n_cols}")
    return n_cols // block_size * type_size


def dequantize(
    data: torch.Tensor,
    qtype: int | GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Unpack GGUF bytes into a `shape` tensor of `dtype`, on `data`'s device.

    `data` is uint8 holding exactly the packed blocks of a tensor whose torch-order (row-major,
    `[out_features, in_features]`) shape is `shape`; its own shape does not matter (`[rows,
    bytes_per_row]` and flat both work). Values are computed in fp32 bit-exactly as
    `gguf.quants.dequantize` does, then cast to `dtype`. Rows are contiguous blocks, so any row
    gather/permutation applied to `data` beforehand commutes with this function.

    Raises `UnsupportedQuantTypeError` for types outside `SUPPORTED_TYPES`, `TypeError` when `data`
    is not uint8 and `ValueError` when the byte count does not match `shape`.
    """
    qtype = as_quant_type(qtype)
    if data.dtype != torch.uint8:
        raise TypeError(f"GGUF tensor data must be uint8 bytes, got {data.dtype}")
    shape = tuple(int(s) for s in shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    num_values = math.prod(shape)
    if not shape or shape[-1] % block_size:
        raise ValueError(f"{qtype.name} tensor shape {shape}: last dimension must be a multiple of {block_size}")
    num_blocks = num_values // block_size
    if data.numel() != num_blocks * type_size:
        raise ValueError(
            f"{qtype.name} tensor of shape {shape} needs {num_blocks * type_size} bytes, got {data.numel()}"
        )
    blocks = data.reshape(num_blocks, type_size)
    fn = DEQUANTIZE_BLOCKS[qtype]
    step = max(1, _MAX_CHUNK_ELEMENTS // block_size)
    if num_blocks <= step:
        return fn(blocks).to(dtype).reshape(shape)
    out = torch.empty((num_blocks, block_size), dtype=dtype, device=data.device)
    for start in range(0, num_blocks, step):
        out[start : start + step] = fn(blocks[start : start + step])
    return out.reshape(shape)


def dequantize_slice(
    data: torch.Tensor,
    qtype: int | GGMLQuantizationType,
    bounds: tuple[tuple[int, int], ...],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The values ``[start, end)`` along every dimension (``bounds``) of a packed GGUF tensor, in
    ``dtype`` on ``device``, decoding only the blocks that hold them.

    ``data`` is uint8 ``[*shape[:-1], bytes_per_row]`` (a ``TensorInfo.data``). Leading dimensions
    are plain byte views; along the last, the whole blocks covering ``[start, end)`` are moved to
    ``device``, dequantized (as :func:`dequantize`, so bit-exact with gguf-py) and trimmed::

        row:    | block 0 | block 1 | block 2 | block 3 |        (block_size values each)
        wanted:               [start ....... end)
        decoded:          | block 1 | block 2 |  -> values [start - block_size, end - block_size)
    """
    qtype = as_quant_type(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    *leading, (start, end) = bounds
    first, last = start // block_size, -(-end // block_size)
    packed = data[(*(slice(low, high) for low, high in leading), slice(first * type_size, last * type_size))]
    if device is not None:
        packed = packed.to(device)
    shape = (*(high - low for low, high in leading), (last - first) * block_size)
    values = dequantize(packed, qtype, shape, dtype)
    offset = start - first * block_size
    return values[..., offset : offset + end - start]
