"""Per-type GGUF block decoding inside Triton kernels, and the planar layout the GPU keeps weights in.

Every kernel of :mod:`fw_gguf.kernels` works on a weight tile ``[BLOCK_N, NB, G, S]``: ``BLOCK_N``
rows, ``NB`` consecutive blocks of each row, and each block seen as ``G`` groups of ``S`` values in
ggml's element order (``element = g * S + s``; ``G`` is the number of per-group scales: 8 for
Q4_K, 16 for Q6_K, 1 for Q8_0). :func:`decode` returns, for one type (a constexpr), the exact
integer quant of every element and the fp32 ``scale`` / ``offset`` of its group such that::

    value = q * scale - offset          (two roundings: gguf-py's order, so bit-exact unfused)

Scales are loaded once per group (``[BLOCK_N, NB, G, 1]``), quants once per element; within a
group the quant bytes are contiguous in ``s``, so the loads vectorize when the byte address is
aligned.

Two byte layouts are read (constexpr ``PLANAR``):

* ``PLANAR=False``: the GGUF file's blocks, ``[T, type_size]`` bytes for ``T`` blocks in all.
* ``PLANAR=True``: the same bytes regrouped by field: every block's field ``f`` (d, scales, qs...,
  in block order) side by side in one plane, the planes one after the other::

      GGUF:    | d qs | d qs | d qs | ...          (Q8_0: 34-byte blocks, 2-byte aligned)
      planar:  | d d d ... | qs qs qs ... |        (quants 32-byte aligned: 16-byte loads)

  A field starting at byte ``start`` of a block then starts at byte ``T * start`` of the tensor,
  since the planes before it hold exactly ``start`` bytes per block. Same bytes, same size
  (:func:`fw_gguf.kernels.layout.to_planar` / ``from_planar`` are exact inverses).
"""

from __future__ import annotations

import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from fw_gguf.kernels.layout import FIELDS, GROUPS, KERNEL_TYPES, from_planar, to_planar

__all__ = ["FIELDS", "GROUPS", "KERNEL_TYPES", "decode", "decode_weights", "from_planar", "to_planar"]

Q = GGMLQuantizationType

# ggml type ids, as constexprs the kernels compare against
Q4_0: tl.constexpr = tl.constexpr(int(Q.Q4_0))
Q4_1: tl.constexpr = tl.constexpr(int(Q.Q4_1))
Q5_0: tl.constexpr = tl.constexpr(int(Q.Q5_0))
Q5_1: tl.constexpr = tl.constexpr(int(Q.Q5_1))
Q8_0: tl.constexpr = tl.constexpr(int(Q.Q8_0))
Q2_K: tl.constexpr = tl.constexpr(int(Q.Q2_K))
Q3_K: tl.constexpr = tl.constexpr(int(Q.Q3_K))
Q4_K: tl.constexpr = tl.constexpr(int(Q.Q4_K))
Q5_K: tl.constexpr = tl.constexpr(int(Q.Q5_K))
Q6_K: tl.constexpr = tl.constexpr(int(Q.Q6_K))
IQ4_NL: tl.constexpr = tl.constexpr(int(Q.IQ4_NL))
IQ4_XS: tl.constexpr = tl.constexpr(int(Q.IQ4_XS))


def _signed_words() -> tuple[int, ...]:
    from fw_gguf.dequant import IQ4_LEVEL_WORDS

    return tuple(word - (1 << 32) if word >= 1 << 31 else word for word in IQ4_LEVEL_WORDS)


# IQ4's 16 int8 levels packed little-endian into four int32 words (no table in memory)
_IQ4_WORDS = _signed_words()
IQ4_W0: tl.constexpr = tl.constexpr(_IQ4_WORDS[0])
IQ4_W1: tl.constexpr = tl.constexpr(_IQ4_WORDS[1])
IQ4_W2: tl.constexpr = tl.constexpr(_IQ4_WORDS[2])
IQ4_W3: tl.constexpr = tl.constexpr(_IQ4_WORDS[3])


@triton.jit
def _field(w_ptr, blk, T, START: tl.constexpr, SIZE: tl.constexpr, TYPE_SIZE: tl.constexpr, PLANAR: tl.constexpr):
    """Pointer to the field at byte ``START`` (``SIZE`` bytes) of block ``blk``."""
    if PLANAR:
        return w_ptr + T * START + blk * SIZE
    else:
        return w_ptr + blk * TYPE_SIZE + START


@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, mask):
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _signed8(byte):
    return (byte ^ 128) - 128


@triton.jit
def _small_int_to_float(value):
    """``value`` (int32, ``|value| < 2**22``) as the exactly equal fp32, by adding it to the bits of
    1.5 * 2**23 and subtracting that float: two full-rate operations instead of a conversion, which
    runs at a fraction of the rate and would bound a 4-bit GEMV below the memory bandwidth."""
    return (value + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _iq4_level(nibble):
    word = tl.where(nibble < 8, tl.where(nibble < 4, IQ4_W0, IQ4_W1), tl.where(nibble < 12, IQ4_W2, IQ4_W3))
    return _signed8((word >> ((nibble & 3) * 8)) & 255)


@triton.jit
def decode(w_ptr, blk, T, g, s, mask, QTYPE: tl.constexpr, PLANAR: tl.constexpr):
    """``(q, scale, offset)`` fp32 of the tile (see the module docstring): ``blk`` ``[BN, NB, 1, 1]``
    global block indices (row * blocks per row + block), ``g`` ``[1, 1, G, 1]``, ``s`` ``[1, 1, 1, S]``,
    ``mask`` ``[BN, NB, 1, 1]`` (masked blocks decode to scale 0 and offset 0)."""
    q, scale, offset = _decode_int(w_ptr, blk, T, g, s, mask, QTYPE, PLANAR)
    return _small_int_to_float(q), scale, offset


@triton.jit
def decode_weights(w_ptr, blk, T, g, s, mask, QTYPE: tl.constexpr, PLANAR: tl.constexpr):
    """The tile's fp32 weights for a matmul (arguments as :func:`decode`): ``q * scale`` rounded
    once as the reference rounds it, then ``- offset`` (types with an offset), so the reference's
    fp32 values up to the sign of a zero. The product is one FMA on the quant biased by
    ``1.5 * 2**23`` (its bits, as :func:`_small_int_to_float` makes them, without the subtraction)::

        fma(1.5 * 2**23 + q, scale, -(1.5 * 2**23 * scale))  =  round(q * scale)

    exact because the FMA rounds once and ``1.5 * 2**23 * scale`` is exact (``scale`` has at most
    19 significant bits: an fp16 times a scale of at most 8 bits, once per group). Offset-free
    types (Q8_0, Q4_0, Q5_0, Q3_K, Q6_K, IQ4) take one fp32 operation per weight instead of two."""
    q, scale, offset = _decode_int(w_ptr, blk, T, g, s, mask, QTYPE, PLANAR)
    biased = (q + 0x4B400000).to(tl.float32, bitcast=True)
    return tl.fma(biased, scale, -(scale * 12582912.0)) - offset


@triton.jit
def _decode_int(w_ptr, blk, T, g, s, mask, QTYPE: tl.constexpr, PLANAR: tl.constexpr):
    """:func:`decode` with ``q`` as the exact int32 quant."""
    if QTYPE == Q8_0:
        d = _f16(_field(w_ptr, blk, T, 0, 2, 34, PLANAR), mask)
        q = _signed8(_u8(_field(w_ptr, blk, T, 2, 32, 34, PLANAR) + s, mask))
        scale, offset = d, tl.zeros_like(d)
    elif QTYPE == Q4_0 or QTYPE == IQ4_NL:
        d = _f16(_field(w_ptr, blk, T, 0, 2, 18, PLANAR), mask)
        nibble = (_u8(_field(w_ptr, blk, T, 2, 16, 18, PLANAR) + (s % 16), mask) >> ((s // 16) * 4)) & 15
        q = nibble - 8 if QTYPE == Q4_0 else _iq4_level(nibble)
        scale, offset = d, tl.zeros_like(d)
    elif QTYPE == Q4_1:
        d = _f16(_field(w_ptr, blk, T, 0, 2, 20, PLANAR), mask)
        m = _f16(_field(w_ptr, blk, T, 2, 2, 20, PLANAR), mask)
        q = (_u8(_field(w_ptr, blk, T, 4, 16, 20, PLANAR) + (s % 16), mask) >> ((s // 16) * 4)) & 15
        scale, offset = d, -m
    elif QTYPE == Q5_0:
        d = _f16(_field(w_ptr, blk, T, 0, 2, 22, PLANAR), mask)
        high = (_u8(_field(w_ptr, blk, T, 2, 4, 22, PLANAR) + s // 8, mask) >> (s % 8)) & 1
        low = (_u8(_field(w_ptr, blk, T, 6, 16, 22, PLANAR) + (s % 16), mask) >> ((s // 16) * 4)) & 15
        q = (low | (high << 4)) - 16
        scale, offset = d, tl.zeros_like(d)
    elif QTYPE == Q5_1:
        d = _f16(_field(w_ptr, blk, T, 0, 2, 24, PLANAR), mask)
        m = _f16(_field(w_ptr, blk, T, 2, 2, 24, PLANAR), mask)
        high = (_u8(_field(w_ptr, blk, T, 4, 4, 24, PLANAR) + s // 8, mask) >> (s % 8)) & 1
        low = (_u8(_field(w_ptr, blk, T, 8, 16, 24, PLANAR) + (s % 16), mask) >> ((s // 16) * 4)) & 15
        q = low | (high << 4)
        scale, offset = d, -m
    elif QTYPE == Q2_K:
        # 16 groups of 16; group g: qs byte 32 * (g // 8) + 16 * (g % 2) + s, bits 2 * ((g % 8) // 2)
        sc = _u8(_field(w_ptr, blk, T, 0, 16, 84, PLANAR) + g, mask)
        d = _f16(_field(w_ptr, blk, T, 80, 2, 84, PLANAR), mask)
        dmin = _f16(_field(w_ptr, blk, T, 82, 2, 84, PLANAR), mask)
        byte = _u8(_field(w_ptr, blk, T, 16, 64, 84, PLANAR) + (g // 8) * 32 + (g % 2) * 16 + s, mask)
        q = (byte >> (((g % 8) // 2) * 2)) & 3
        scale, offset = d * (sc & 15).to(tl.float32), dmin * (sc >> 4).to(tl.float32)
    elif QTYPE == Q3_K:
        # 6-bit signed scales: low nibbles in bytes 0..7, top 2 bits in bytes 8..11 (of the 12)
        scales = _field(w_ptr, blk, T, 96, 12, 110, PLANAR)
        low = (_u8(scales + g % 8, mask) >> ((g // 8) * 4)) & 15
        top = (_u8(scales + 8 + g % 4, mask) >> ((g // 4) * 2)) & 3
        d = _f16(_field(w_ptr, blk, T, 108, 2, 110, PLANAR), mask)
        byte = _u8(_field(w_ptr, blk, T, 32, 64, 110, PLANAR) + (g // 8) * 32 + (g % 2) * 16 + s, mask)
        hmask = _u8(_field(w_ptr, blk, T, 0, 32, 110, PLANAR) + (g % 2) * 16 + s, mask)
        q = ((byte >> (((g % 8) // 2) * 2)) & 3) - ((((hmask >> (g // 2)) & 1) ^ 1) << 2)
        scale, offset = d * ((low | (top << 4)) - 32).to(tl.float32), tl.zeros_like(d)
    elif QTYPE == Q4_K or QTYPE == Q5_K:
        TS: tl.constexpr = 144 if QTYPE == Q4_K else 176
        QS: tl.constexpr = 16 if QTYPE == Q4_K else 48
        d = _f16(_field(w_ptr, blk, T, 0, 2, TS, PLANAR), mask)
        dmin = _f16(_field(w_ptr, blk, T, 2, 2, TS, PLANAR), mask)
        scales = _field(w_ptr, blk, T, 4, 12, TS, PLANAR)
        a = _u8(scales + g % 4, mask)
        b = _u8(scales + 4 + g % 4, mask)
        c = _u8(scales + 8 + g % 4, mask)
        sc = tl.where(g < 4, a & 63, (c & 15) | ((a >> 2) & 48))
        mn = tl.where(g < 4, b & 63, (c >> 4) | ((b >> 2) & 48))
        q = (_u8(_field(w_ptr, blk, T, QS, 128, TS, PLANAR) + (g // 2) * 32 + s, mask) >> ((g % 2) * 4)) & 15
        if QTYPE == Q5_K:
            q = q | (((_u8(_field(w_ptr, blk, T, 16, 32, TS, PLANAR) + s, mask) >> g) & 1) << 4)
        scale, offset = d * sc.to(tl.float32), dmin * mn.to(tl.float32)
    elif QTYPE == Q6_K:
        # element e = 16 g + s: half h = e // 128, r = e % 128; low nibble from ql, 2 high bits from qh
        e = g * 16 + s
        r = e % 128
        low = (_u8(_field(w_ptr, blk, T, 0, 128, 210, PLANAR) + (e // 128) * 64 + r % 64, mask) >> ((r // 64) * 4)) & 15
        high = (
            _u8(_field(w_ptr, blk, T, 128, 64, 210, PLANAR) + (e // 128) * 32 + r % 32, mask) >> ((r // 32) * 2)
        ) & 3
        q = (low | (high << 4)) - 32
        sc = _signed8(_u8(_field(w_ptr, blk, T, 192, 16, 210, PLANAR) + g, mask))
        d = _f16(_field(w_ptr, blk, T, 208, 2, 210, PLANAR), mask)
        scale, offset = d * sc.to(tl.float32), tl.zeros_like(d)
    else:
        tl.static_assert(QTYPE == IQ4_XS, "decode: unsupported GGUF type")
        d = _f16(_field(w_ptr, blk, T, 0, 2, 136, PLANAR), mask)
        high_bits = _field(w_ptr, blk, T, 2, 2, 136, PLANAR)
        top = ((_u8(high_bits, mask) | (_u8(high_bits + 1, mask) << 8)) >> (g * 2)) & 3
        low = (_u8(_field(w_ptr, blk, T, 4, 4, 136, PLANAR) + g // 2, mask) >> ((g % 2) * 4)) & 15
        nibble = (_u8(_field(w_ptr, blk, T, 8, 128, 136, PLANAR) + g * 16 + s % 16, mask) >> ((s // 16) * 4)) & 15
        q = _iq4_level(nibble)
        scale, offset = d * ((low | (top << 4)) - 32).to(tl.float32), tl.zeros_like(d)
    return q, scale, offset
