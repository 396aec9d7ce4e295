"""What the one-row FP4 kernels share: e2m1 codes times int8 activations on integer dot products.

An e2m1 value times 2 is an integer in -12..12, so a word of 8 codes (code i in bits 4i .. 4i+3,
sign in the top bit) becomes two words of four signed bytes by a byte-permute table lookup, and
two ``dp4a`` multiply them by eight int8 activations (``x`` rounded per 32 inputs as
``fw_gguf``'s and ``fw_gptq``'s integer GEMVs round it)::

    m = w & 0x77777777                                 magnitudes, as byte selectors 0..7
    s = ((w >> 1) & 0x44444444) | 0x32103210           select the negative table's byte where the sign is set
    pos = prmt(0x03020100, 0x0C080604, m)              2|v|: 0 1 2 3 4 6 8 12
    neg = prmt(0xFDFEFF00, 0xF4F8FAFC, m)              -2|v|
    lo  = prmt(pos, neg, s)                            codes 0..3 as signed bytes (and codes 4..7 from w >> 16)
    dot = dp4a(lo, x[0:4]) + dp4a(hi, x[4:8])

Eleven integer instructions and two ``dp4a`` for 8 codes (the float decode took ~7 a code). The
integer sums of a scale group are exact; each group's sum is converted once and multiplied by its
weight scale and the activations' scale. Under the Triton interpreter (no inline PTX) the same
integers come from shifts and compares.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: ``2^-15``: the codes' factor 2 and the 2^14 the scale bytes carry for the fp16 placement (``fp4_decode``).
CODE_SCALE = 2.0**-15

#: The PTX of :func:`word_dot`: ``$0 = dot(codes $1, x bytes $2 (codes 0..3) and $3 (codes 4..7))``.
WORD_DOT_PTX = tl.constexpr(
    """{
.reg .b32 r_m, r_s, r_mh, r_sh, r_p0, r_p1, r_n0, r_n1, r_pos, r_neg, r_lo, r_hi, r_d;
mov.b32 r_p0, 0x03020100;
mov.b32 r_p1, 0x0C080604;
mov.b32 r_n0, 0xFDFEFF00;
mov.b32 r_n1, 0xF4F8FAFC;
and.b32 r_m, $1, 0x77777777;
shr.u32 r_s, $1, 1;
and.b32 r_s, r_s, 0x44444444;
or.b32 r_s, r_s, 0x32103210;
prmt.b32 r_pos, r_p0, r_p1, r_m;
prmt.b32 r_neg, r_n0, r_n1, r_m;
prmt.b32 r_lo, r_pos, r_neg, r_s;
shr.u32 r_mh, r_m, 16;
shr.u32 r_sh, r_s, 16;
prmt.b32 r_pos, r_p0, r_p1, r_mh;
prmt.b32 r_neg, r_n0, r_n1, r_mh;
prmt.b32 r_hi, r_pos, r_neg, r_sh;
dp4a.s32.s32 r_d, r_lo, $2, 0;
dp4a.s32.s32 $0, r_hi, $3, r_d;
}"""
)


def emulate() -> bool:
    """Whether the kernels must compute ``prmt`` / ``dp4a`` without inline PTX (the interpreter)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def word_dot(w, x_lo, x_hi, EMULATE: tl.constexpr):
    """Per int32 lane: ``sum_i 2 e2m1(code i of w) * x_i`` with ``x_0..3`` the signed bytes of
    ``x_lo`` and ``x_4..7`` those of ``x_hi`` (int32)."""
    if EMULATE:
        total = tl.zeros_like(w)
        for i in tl.static_range(8):
            code = (w >> (4 * i)) & 15
            magnitude = code & 7
            exponent = magnitude >> 1
            mantissa = magnitude & 1
            twice = tl.where(exponent == 0, mantissa, (2 + mantissa) << tl.maximum(exponent - 1, 0))
            twice = tl.where(code >= 8, -twice, twice)
            if i < 4:
                byte = (x_lo >> (8 * i)) & 255
            else:
                byte = (x_hi >> (8 * (i - 4))) & 255
            total += twice * ((byte ^ 128) - 128)
        return total
    else:
        return tl.inline_asm_elementwise(
            WORD_DOT_PTX,
            "=r,r,r,r",
            [w, x_lo, x_hi],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )


@triton.jit
def quantize_x(x_ptr, k0, K, XG: tl.constexpr):
    """``x[k0 : k0 + 32 XG]`` rounded to int8 per group of 32 (round half away from zero, scale
    ``max|x| / 127``): ``(words [XG, 8] int32, four quants each in input order; d [XG] fp32, the
    group scales times CODE_SCALE)``. Inputs past ``K`` are 0."""
    k = k0 + tl.arange(0, 32 * XG)
    x = tl.reshape(tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32), (XG, 32))
    amax = tl.max(tl.abs(x), axis=1)
    inverse = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    scaled = x * inverse[:, None]
    quants = (scaled + tl.where(scaled >= 0, 0.5, -0.5)).to(tl.int32)
    shifts = (tl.arange(0, 4) * 8)[None, None, :]
    words = tl.sum((tl.reshape(quants, (XG, 8, 4)) & 255) << shifts, axis=2)  # disjoint bytes: sum = OR
    return words, amax * (3.0517578125e-05 / 127.0)  # CODE_SCALE / 127


@triton.jit
def split_x_words(words, XG: tl.constexpr, GPX: tl.constexpr, WPG: tl.constexpr):
    """``[XG, 8]`` x words -> ``(lo, hi)`` ``[XG, GPX, WPG]``: the words a code word ``(a, g, w)``
    (inputs ``32 a + 8 (g WPG + w)`` .. ``+ 7``) multiplies."""
    lo, hi = tl.split(tl.reshape(words, (XG, GPX, WPG, 2)))
    return lo, hi


def quantize_x_reference(x: torch.Tensor) -> torch.Tensor:
    """The activations the one-row FP4 kernels multiply, in torch: each 32 inputs of ``x`` (fp32)
    rounded to ``round(x / d) * d``, ``d = max|x| / 127`` (half away from zero; zeros stay zero)."""
    groups = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    scaled = groups * inverse
    quants = torch.trunc(scaled + torch.where(scaled >= 0, 0.5, -0.5))
    return (quants * (amax / 127.0)).reshape(x.shape)
