"""The one-row W4A16 / W8A16 GEMV on integer dot products: ``out[1, N] = x[1, K] @ W.T``, ``W`` in
:mod:`fw_gptq.kernels.layout` (each output's weights one contiguous run over K).

A decode step's GEMV is bound by the weight bytes it reads, but decoding each 4-bit value to a float
and multiplying (what the tile kernel of :mod:`~fw_gptq.kernels.wna16` does) takes ~6 instructions a
value, more than an H200 SM issues while its memory streams. As llama.cpp's GPU GEMV (and
``fw_gguf``'s) does, this kernel rounds x to int8 with one fp32 scale per 32 inputs (round half away
from zero, scale ``max|x| / 127``) and multiplies four weight quants by four x quants in one ``dp4a``::

    program (BLOCK_N outputs, one split of K); a step is STEP inputs = STEP / 32 x-groups j = (g, jg)
    words [BLOCK_N, NG, JG, 4] = qweight[n, k / pf]       loaded first: in flight while x is rounded
    4 bits: word m of x-group j holds inputs 32 j + 8 m + i in nibble i;
            word & 0x0F0F0F0F    = inputs 8m + 0, 2, 4, 6  -> dp4a with x quants (8m + 0, 2, 4, 6)
            word >> 4 & 0x0F0F.. = inputs 8m + 1, 3, 5, 7  -> dp4a with x quants (8m + 1, 3, 5, 7)
    8 bits: word m of x-group j holds inputs 32 j + 4 m + i in byte i: words 0-3 times x quants 0-15,
            words 4-7 times x quants 16-31
    x: one contiguous load of the step, split into the two halves above, rounded per x-group
    sums[n, j] = the eight dp4a of row n's x-group, chained through one accumulator (one thread)
    acc[n, j] += scale[g, n] * (d_x[j] * sums[n, j] - zero[g, n] * d_x[j] * sum_{k in j} x_q[k])
    out[n] = sum_j acc[n, j]                                    (one cross-thread sum, after the K loop)

So the result is the exact dequantized weights times x rounded to 8 bits per 32 inputs:
:func:`quantize_x_reference` is that rounding in torch, for tests. A group of weights is any
multiple of 32 inputs (each x-group reads its own group's scale and zero), channel-wise included;
``g_idx`` (groups out of order, one rank of an act-order weight) is not taken: see
:func:`int8_gemv_supported` (a whole act-order weight's groups are contiguous after the load's sort,
and the caller permutes x). K may be split so that small-N layers fill the SMs: fp32 partial sums per
split, added in a fixed order by the split that arrives last (one launch). No host synchronisation:
CUDA-graph safe once :func:`reserve_counters` ran. Under the Triton interpreter ``dp4a`` is computed
with shifts and multiplies, the same integers.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .layout import KernelWeight

#: Counters the split GEMV's programs arrive on, per device; each launch sets its own back to zero.
COUNTERS = 1 << 14
_counters: dict[torch.device, torch.Tensor] = {}


class GemvConfig(NamedTuple):
    """One launch shape: outputs a program, inputs a step, K splits, warps, pipeline stages."""

    block_n: int
    step: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _dp4a(w, x, acc, EMULATE: tl.constexpr):
    """Per 32-bit lane: ``acc`` plus the four products of ``w``'s unsigned bytes and ``x``'s signed ones."""
    if EMULATE:
        total = acc
        for i in tl.static_range(4):
            total += ((w >> (8 * i)) & 255) * ((((x >> (8 * i)) & 255) ^ 128) - 128)
        return total
    else:
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [w, x, acc], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def _x_words(q, J: tl.constexpr):
    """``[J, 16]`` int8 quants (as int32) -> ``[1, 1, J, 4]`` words, byte b of word m = quant 4 m + b."""
    byte_shift = (tl.arange(0, 4) * 8)[None, None, :]
    # disjoint bytes: the sum is the OR
    return tl.sum(tl.reshape(q & 255, (J, 4, 4)) << byte_shift, axis=2)[None, None, :, :]


@triton.jit
def _word(words, i: tl.constexpr):
    """Word ``i`` (0..3) of the last axis of ``words [.., 4]``, as a tensor without that axis."""
    low, high = tl.split(tl.reshape(words, words.shape[:-1] + [2, 2]))
    return tl.split(low if i < 2 else high)[i % 2]


@triton.jit(do_not_specialize=["stride_sn"])
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
    stride_qn,
    stride_sn,
    split_k,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    STEP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Program (block of ``BLOCK_N`` outputs, split of K out of ``split_k``); K is whole steps of
    ``STEP`` inputs. ``stride_qn``: words a row of ``qweight``. ``SPLIT``: as ``fw_gguf``'s GEMV, partial
    sums in ``partial [split_k, N]``, the last split to count itself in ``counter[pid_n]`` adds them in order."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    J: tl.constexpr = STEP // 32  # x-groups a step
    WPJ: tl.constexpr = BITS  # weight words an x-group: 32 inputs at 32 / BITS a word
    # a step's x-groups as [NG, JG]: NG scale groups of JG x-groups each (one scale row per group, loaded
    # once); a group size that neither divides nor is a multiple of the step: a scale per x-group
    if STEP % GROUP_SIZE == 0:
        NG: tl.constexpr = STEP // GROUP_SIZE
    elif GROUP_SIZE % STEP == 0:
        NG: tl.constexpr = 1
    else:
        NG: tl.constexpr = J
    JG: tl.constexpr = J // NG
    steps = K // STEP
    per_split = tl.cdiv(steps, split_k)
    step_lo = pid_k * per_split
    step_hi = tl.minimum(step_lo + per_split, steps)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < N
    n4 = n[:, None, None, None]
    live4 = live[:, None, None, None]
    live3 = live[:, None, None]
    # each thread multiplies whole 16-byte runs ([.., .., .., 4] words, its own) so that the sum over
    # them stays in the thread: no shuffles in the loop
    j3 = tl.arange(0, NG)[:, None] * JG + tl.arange(0, JG)[None, :]  # [NG, JG]: x-group of the step
    word_of = j3[None, :, :, None] * WPJ + tl.arange(0, 4)[None, None, None, :]  # [1, NG, JG, 4]
    row = qweight_ptr + n4.to(tl.int64) * stride_qn + word_of  # [BN, NG, JG, 4]
    x_at = tl.arange(0, J * 32)
    acc = tl.zeros((BLOCK_N, NG, JG), dtype=tl.float32)
    for step in range(step_lo, step_hi):
        k0 = step * STEP
        # the weights (and their scales) first: in flight while x is rounded below, whose cross-thread
        # reductions and barriers would otherwise hold these loads back until x is done
        at = row + (k0 * BITS // 32)
        first = tl.load(at, mask=live4, other=0)  # [BN, NG, JG, 4]
        if BITS == 8:
            second = tl.load(at + 4, mask=live4, other=0)
        # each x-group's scale, JG x-groups alike: loaded in the layout of the sums they multiply (with
        # the stride along N a runtime value the compiler cannot vectorise these small loads along N,
        # so it keeps them in that layout instead of moving the [BN, NG, JG] sums to theirs every step)
        group = (k0 + j3 * 32) // GROUP_SIZE  # [NG, JG]
        g_at = group[None, :, :] * N + n[:, None, None] * stride_sn  # [BN, NG, JG]
        scale = tl.load(scales_ptr + g_at, mask=live3, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + g_at, mask=live3, other=0.0).to(tl.float32)
        # x: one contiguous load, each x-group rounded to int8 with one scale
        xs = tl.reshape(tl.load(x_ptr + k0 + x_at).to(tl.float32), (J, 16, 2))
        if BITS == 4:  # the even and the odd inputs (low / high nibbles)
            xa, xb = tl.split(xs)
        else:  # the first and the last 16 inputs (the x-group's first / last 4 words)
            xa, xb = tl.split(tl.permute(tl.reshape(xs, (J, 2, 16)), (0, 2, 1)))
        amax = tl.maximum(tl.max(tl.abs(xa), axis=1), tl.max(tl.abs(xb), axis=1))  # [J]
        inverse = (tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0))[:, None]
        qa, qb = xa * inverse, xb * inverse
        qa = (qa + tl.where(qa >= 0, 0.5, -0.5)).to(tl.int32)  # round half away from zero
        qb = (qb + tl.where(qb >= 0, 0.5, -0.5)).to(tl.int32)
        d_x = tl.reshape(amax / 127.0, (NG, JG))[None, :, :]
        # d_x * sum of the quants: the zero point's term, x's alone
        x_term = tl.reshape((amax / 127.0) * (tl.sum(qa, axis=1) + tl.sum(qb, axis=1)).to(tl.float32), (NG, JG))
        wa = tl.reshape(_x_words(qa, J), (1, NG, JG, 4))  # four quants a word
        wb = tl.reshape(_x_words(qb, J), (1, NG, JG, 4))
        # the eight products of a row's x-group chained in one thread's accumulator
        sums = tl.zeros((BLOCK_N, NG, JG), dtype=tl.int32)
        for i in tl.static_range(4):
            if BITS == 4:
                w = _word(first, i)  # inputs 8 i + 2 b (low nibble of byte b), 8 i + 2 b + 1 (high nibble)
                sums = _dp4a(w & 0x0F0F0F0F, _word(wa, i), sums, EMULATE)
                sums = _dp4a((w >> 4) & 0x0F0F0F0F, _word(wb, i), sums, EMULATE)
            else:
                sums = _dp4a(_word(first, i), _word(wa, i), sums, EMULATE)
                sums = _dp4a(_word(second, i), _word(wb, i), sums, EMULATE)
        if HAS_ZEROS:
            acc += scale * (d_x * sums.to(tl.float32) - zero * x_term[None, :, :])
        else:
            acc += scale * (d_x * sums.to(tl.float32) - (1 << (BITS - 1)) * x_term[None, :, :])
    total = tl.sum(tl.reshape(acc, (BLOCK_N, J)), axis=1)
    if SPLIT:
        tl.store(partial_ptr + pid_k * N + n, total, mask=live)
        tl.debug_barrier()  # every thread's partial sums before the release below
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for split in range(0, split_k):  # in order: the same bits on every run
                total += tl.load(partial_ptr + split * N + n, mask=live, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + n, total.to(out_ptr.dtype.element_ty), mask=live)
            tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(out_ptr + n, total.to(out_ptr.dtype.element_ty), mask=live)


def int8_gemv_supported(weight: KernelWeight) -> bool:
    """Whether :func:`int8_gemv` takes ``weight``: 4 or 8 bits, groups in input order (no ``g_idx``),
    a group a multiple of 32 inputs and K a multiple of 32."""
    return (
        weight.bits in (4, 8) and weight.g_idx is None and weight.group_size % 32 == 0 and weight.in_features % 32 == 0
    )


def reserve_counters(device: torch.device) -> torch.Tensor:
    """The device's split counters, allocated (zeroed) on first use, which must come before any
    CUDA-graph capture (:meth:`~fw_gptq.method.WNA16LinearMethod.process_weights_after_loading` does it)."""
    device = torch.device(device)
    if device not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fw_gptq: the int8 GEMV's split counters must be reserved before CUDA-graph capture")
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def largest_step(k: int, max_step: int) -> int:
    """The longest power-of-two step of at most ``max_step`` inputs (at least 32) that divides ``k``."""
    step = max_step
    while step > 32 and k % step:
        step //= 2
    return step


def gemv_config(n: int, k: int, bits: int, num_sms: int) -> GemvConfig:
    """The static rule, ``fw_gguf``'s measured Q4_K / Q8_0 settings carried over (the same bytes a
    value, the same instructions): at 4 bits 64 outputs a program where that gives three programs an
    SM, else 32; at 8 bits 16 (a thread then holds 32 bytes of each row); 1024-input steps (512 bytes
    of a row at 4 bits); K split until the programs cover three times the SMs (at most 8 splits,
    each at least one step)."""
    fill = 3 * num_sms
    block_n = (64 if triton.cdiv(n, 64) >= fill else 32) if bits == 4 else 16
    step = largest_step(k, 1024)
    split_k, programs, steps = 1, triton.cdiv(n, block_n), k // step
    while split_k < 8 and programs * split_k < fill and steps // (2 * split_k) >= 1:
        split_k *= 2
    return GemvConfig(block_n, step, split_k)


#: Settings measured per GPU model (``benchmarks/w4a16_kernels.py --rows 1 --sweep`` prints
#: ``int8_gemv_best``): ``(device name, bits, N, K) -> GemvConfig``; other shapes use :func:`gemv_config`.
GEMV_TUNED: dict[tuple[str, int, int, int], GemvConfig] = {}


def gemv_setting(weight: KernelWeight, device: torch.device) -> GemvConfig:
    """What :func:`int8_gemv` launches by default: the measured setting for this GPU and shape, else the rule's."""
    from .wna16 import _num_sms

    n, k = weight.out_features, weight.in_features
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return GEMV_TUNED.get((name, weight.bits, n, k)) or gemv_config(n, k, weight.bits, _num_sms(device))


def int8_gemv(
    x: torch.Tensor, weight: KernelWeight, out: torch.Tensor | None = None, config: GemvConfig | None = None
) -> torch.Tensor:
    """``x [1, K] @ W.T -> [1, N]`` in ``x.dtype`` (``out``: where to write it, a row of contiguous
    columns); ``x`` in the kernel's input order (act-order already applied by the caller), contiguous.
    ``config`` overrides :func:`gemv_setting` (its ``step`` must divide K and be a power of two >= 32)."""
    if x.shape[0] != 1 or not int8_gemv_supported(weight):
        raise ValueError(
            f"int8_gemv: one row of a 4/8-bit weight with contiguous groups of a multiple of 32 inputs; got "
            f"{tuple(x.shape)} rows, {weight.bits} bits, group {weight.group_size}, g_idx "
            f"{'set' if weight.g_idx is not None else 'None'}"
        )
    n, k = weight.out_features, weight.in_features
    config = config or gemv_setting(weight, x.device)
    if k % config.step or config.step < 32 or config.step & (config.step - 1):
        raise ValueError(f"int8_gemv: step {config.step} must be a power of two >= 32 dividing K = {k}")
    blocks = triton.cdiv(n, config.block_n)
    split_k = min(config.split_k, k // config.step)
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
        weight.qweight.stride(0),
        weight.scales.stride(1),
        split_k,
        BITS=weight.bits,
        GROUP_SIZE=weight.group_size,
        HAS_ZEROS=weight.zeros is not None,
        STEP=config.step,
        BLOCK_N=config.block_n,
        SPLIT=split,
        EMULATE=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
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
