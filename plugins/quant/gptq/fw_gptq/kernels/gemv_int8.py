"""The one-row W4A16 / W8A16 GEMV on integer dot products: ``out[1, N] = x[1, K] @ W.T``, ``W`` in
:mod:`fw_gptq.kernels.layout`.

A decode step's GEMV is bound by the weight bytes it reads, but decoding each 4-bit value to a float
and multiplying (what the tile kernel of :mod:`~fw_gptq.kernels.wna16` does) takes ~6 instructions a
value, more than an H200 SM issues while its memory streams. As llama.cpp's GPU GEMV (and
``fw_gguf``'s) does, this kernel rounds x to int8 with one fp32 scale per 32 inputs (round half away
from zero, scale ``max|x| / 127``) and multiplies four weight quants by four x quants in one ``dp4a``:

    4 bits: a word holds inputs 8w .. 8w + 7 of one column (nibble i = input 8w + i);
            ``word & 0x0F0F0F0F`` are the even inputs, ``(word >> 4) & 0x0F0F0F0F`` the odd ones, each
            multiplied by the x quants of the same positions packed into a word
    8 bits: a word holds inputs 4w .. 4w + 3 (byte i = input 4w + i), multiplied as it is

    out[n] = sum_g scale[g, n] * sum_{j in g} d_x[j] * (sum_{k in j} q[k, n] x_q[k] - zero[g, n] sum_{k in j} x_q[k])

So the result is the exact dequantized weights times x rounded to 8 bits per 32 inputs:
:func:`quantize_x_reference` is that rounding in torch, for tests. The weights are read in their
``[K / pf, N]`` layout: a program covers ``BLOCK_N`` columns, so each row of words it loads is a
contiguous run. ``g_idx`` (groups out of order after act-order's sort) is not taken: see
:func:`int8_gemv_supported`. K may be split so that small-N layers fill the SMs: fp32 partial sums per
split, added in a fixed order by the split that arrives last (one launch). No host synchronisation:
CUDA-graph safe. Under the Triton interpreter ``dp4a`` is computed with shifts and multiplies.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .layout import KernelWeight

#: Counters the split GEMV's programs arrive on, per device; each launch sets its own back to zero.
COUNTERS = 1 << 14
_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _dp4a(w, x, EMULATE: tl.constexpr):
    """Per 32-bit lane: the sum of the four products of ``w``'s unsigned bytes and ``x``'s signed ones."""
    if EMULATE:
        total = tl.zeros_like(w)
        for i in tl.static_range(4):
            total += ((w >> (8 * i)) & 255) * ((((x >> (8 * i)) & 255) ^ 128) - 128)
        return total
    else:
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, 0;", "=r,r,r", [w, x], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def _pack_bytes(quants):
    """``[R, 4]`` int32 values in -128..127 -> ``[R]`` words (value i in byte i)."""
    shifts = (tl.arange(0, 4) * 8)[None, :]
    return tl.sum((quants & 255) << shifts, axis=1)  # disjoint bytes: the sum is the OR


@triton.jit
def _int8_gemv_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    N,
    K,
    split_k,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    STEP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Program (block of ``BLOCK_N`` columns, split of K out of ``split_k``); each step is ``STEP``
    inputs (one group or a part of one). ``SPLIT``: as ``fw_gguf``'s GEMV, partial sums in
    ``partial [split_k, N]``, the last split to count itself in ``counter[pid_n]`` adds them in order."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    J: tl.constexpr = STEP // 32  # x's groups of 32 a step
    PACK: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = STEP // PACK  # weight words per column a step
    steps = K // STEP
    per_split = tl.cdiv(steps, split_k)
    step_lo = pid_k * per_split
    step_hi = tl.minimum(step_lo + per_split, steps)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for step in range(step_lo, step_hi):
        k0 = step * STEP
        x = tl.reshape(tl.load(x_ptr + k0 + tl.arange(0, STEP)).to(tl.float32), (J, 32))
        amax = tl.max(tl.abs(x), axis=1)
        inverse = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
        scaled = x * inverse[:, None]
        quants = (scaled + tl.where(scaled >= 0, 0.5, -0.5)).to(tl.int32)  # round half away from zero
        x_sums = tl.sum(quants, axis=1).to(tl.float32)  # [J]
        rows = k0 // PACK + tl.arange(0, WORDS)
        words = tl.load(qweight_ptr + rows[:, None] * N + n[None, :], mask=live[None, :], other=0)  # [WORDS, BN]
        if BITS == 4:
            even, odd = tl.split(tl.reshape(quants, (WORDS, 4, 2)))  # inputs 8w + 2i and 8w + 2i + 1
            products = _dp4a(words & 0x0F0F0F0F, _pack_bytes(even)[:, None], EMULATE) + _dp4a(
                (words >> 4) & 0x0F0F0F0F, _pack_bytes(odd)[:, None], EMULATE
            )
        else:
            tl.static_assert(BITS == 8, "_int8_gemv_kernel: 4 or 8 bits")
            products = _dp4a(words, _pack_bytes(tl.reshape(quants, (WORDS, 4)))[:, None], EMULATE)
        sums = tl.sum(tl.reshape(products, (J, WORDS // J, BLOCK_N)), axis=1).to(tl.float32)  # [J, BN]
        group = k0 // GROUP_SIZE
        scale = tl.load(scales_ptr + group * N + n, mask=live, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + group * N + n, mask=live, other=0.0).to(tl.float32)
        else:
            zero = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.float32)
        d_x = (amax / 127.0)[:, None]
        acc += scale * tl.sum(d_x * (sums - zero[None, :] * x_sums[:, None]), axis=0)
    if SPLIT:
        tl.store(partial_ptr + pid_k * N + n, acc, mask=live)
        tl.debug_barrier()  # every thread's partial sums before the release below
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for split in range(0, split_k):  # in order: the same bits on every run
                total += tl.load(partial_ptr + split * N + n, mask=live, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + n, total.to(out_ptr.dtype.element_ty), mask=live)
            tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty), mask=live)


def step_of(weight: KernelWeight) -> int:
    """Inputs a step: the group (at most 256), so that a step never crosses a group."""
    return min(weight.group_size, 256)


def int8_gemv_supported(weight: KernelWeight) -> bool:
    """Whether :func:`int8_gemv` takes ``weight``: 4 or 8 bits, groups in input order (no ``g_idx``),
    a group a multiple of 32 inputs (or, over 256, of 256) and K whole steps."""
    if weight.bits not in (4, 8) or weight.g_idx is not None:
        return False
    step = step_of(weight)
    return step % 32 == 0 and weight.group_size % step == 0 and weight.in_features % step == 0


def reserve_counters(device: torch.device) -> torch.Tensor:
    """The device's split counters, allocated (zeroed) on first use, which must come before any
    CUDA-graph capture (the first eager forward does it)."""
    device = torch.device(device)
    if device not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fw_gptq: the int8 GEMV's split counters must be reserved before CUDA-graph capture")
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def gemv_config(n: int, k: int, step: int, num_sms: int) -> tuple[int, int]:
    """``(BLOCK_N, split_k)``: 64 columns a program; K split (up to 8, each at least 2 steps) until
    the programs cover twice the SMs."""
    block_n = 64
    programs, split_k = triton.cdiv(n, block_n), 1
    while split_k < 8 and programs * split_k < 2 * num_sms and (k // step) >= 4 * split_k:
        split_k *= 2
    return block_n, split_k


def int8_gemv(
    x: torch.Tensor,
    weight: KernelWeight,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    split_k: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """``x [1, K] @ W.T -> [1, N]`` in ``x.dtype``; ``x`` in the kernel's input order (act-order
    already applied by the caller), contiguous. ``block_n`` / ``split_k`` override the rule."""
    assert x.shape[0] == 1 and int8_gemv_supported(weight), "int8_gemv: one row of a supported weight"
    n, k = weight.out_features, weight.in_features
    step = step_of(weight)
    from .wna16 import _num_sms

    rule_n, rule_split = gemv_config(n, k, step, _num_sms(x.device))
    block_n, split_k = block_n or rule_n, split_k or rule_split
    blocks = triton.cdiv(n, block_n)
    split = split_k > 1
    if split and blocks > COUNTERS:
        raise ValueError(f"a split GEMV over {blocks} column blocks needs more than {COUNTERS} counters")
    target = out if out is not None else torch.empty(1, n, dtype=x.dtype, device=x.device)
    partial = torch.empty(split_k, n, dtype=torch.float32, device=x.device) if split else target
    zeros = weight.zeros if weight.zeros is not None else weight.scales
    _int8_gemv_kernel[(blocks, split_k)](
        x,
        weight.qweight,
        weight.scales,
        zeros,
        target,
        partial,
        reserve_counters(x.device),
        n,
        k,
        split_k,
        BITS=weight.bits,
        GROUP_SIZE=weight.group_size,
        HAS_ZEROS=weight.zeros is not None,
        STEP=step,
        BLOCK_N=block_n,
        SPLIT=split,
        EMULATE=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=num_warps,
    )
    return target


def quantize_x_reference(x: torch.Tensor) -> torch.Tensor:
    """The activations :func:`int8_gemv` multiplies, in torch: each 32 inputs of ``x`` rounded to
    ``round(x / d) * d``, ``d = max|x| / 127`` (half away from zero; a group of zeros stays zero), fp32."""
    groups = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    scaled = groups * inverse
    quants = torch.trunc(scaled + torch.where(scaled >= 0, 0.5, -0.5))
    return (quants * (amax / 127.0)).reshape(x.shape)
