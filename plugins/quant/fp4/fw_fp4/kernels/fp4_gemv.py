"""The one-row FP4 GEMV on integer dot products: ``out[1, N] = x[1, K] @ W.T``, ``W`` in
:mod:`fw_fp4.kernels.layout` (``codes`` int32 ``[K/8, N]``, scale bytes ``[K/G, N]``, NVFP4's row scales).

A decode step is bound by the weight bytes it reads. The float decode of :mod:`~fw_fp4.kernels.fp4_linear`'s
GEMV takes ~7 instructions a code (~15 a weight byte); this kernel rounds x to int8 per 32 inputs
and multiplies a word of 8 codes in 13 integer instructions (:mod:`fw_fp4.kernels.int8_dot`)::

    out[n] = row_scale[n] * sum_a d_x[a] * sum_{g in a} scale[g, n] * sum_{j in g} dot(word[j, n], x_q words of j)

So the result is that of the exact dequantized weights times x rounded to 8 bits per 32 inputs
(:func:`fw_fp4.kernels.int8_dot.quantize_x_reference`), not times x itself.

Each program covers ``BLOCK_N`` outputs (``128 * num_warps``: a warp's lanes hold 4 adjacent
outputs each, so every row of words a step loads is ``BLOCK_N`` contiguous words and the sums
over a group's words stay in one thread) and a split of K in steps of ``STEP`` inputs, loaded as
``[STEP / 32, 32 / G, G / 8, BLOCK_N]`` (x group, scale group, word). K is split while the
programs are few: fp32 partial sums per split, added in a fixed order by the split that arrives
last (one launch, as ``fw_gguf``'s GEMV). Nothing syncs with the host: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fp4_decode import scale_factor
from .int8_dot import emulate, quantize_x, split_x_words, word_dot
from .layout import GROUP_SIZES, Fp4KernelWeight

#: Counters the split programs arrive on, per device; each launch sets the ones it used back to zero.
COUNTERS = 1 << 14
_counters: dict[torch.device, Tensor] = {}


@triton.jit
def fp4_int8_gemv_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    row_scales_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    N,
    K,
    split_k,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    HAS_ROW_SCALES: tl.constexpr,
    STEP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Program (block of ``BLOCK_N`` outputs, split of K out of ``split_k``). ``SPLIT``: each split
    stores its sums in its row of ``partial [split_k, N]`` and counts itself in ``counter[pid_n]``;
    the last to count adds the rows in order, writes ``out`` and sets the counter back to zero."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    XG: tl.constexpr = STEP // 32  # x groups a step
    GPX: tl.constexpr = 32 // GROUP  # scale groups an x group
    WPG: tl.constexpr = GROUP // 8  # words a scale group
    steps = tl.cdiv(K, STEP)
    per_split = tl.cdiv(steps, split_k)
    step_lo = pid_k * per_split
    step_hi = tl.minimum(step_lo + per_split, steps)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < N
    a = tl.arange(0, XG)[:, None, None]
    g = tl.arange(0, GPX)[None, :, None]
    w = tl.arange(0, WPG)[None, None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for step in range(step_lo, step_hi):
        k0 = step * STEP
        x_words, d_x = quantize_x(x_ptr, k0, K, XG)
        x_lo, x_hi = split_x_words(x_words, XG, GPX, WPG)
        word = k0 // 8 + a * 4 + g * WPG + w  # [XG, GPX, WPG]
        mask = (word < K // 8)[:, :, :, None] & live[None, None, None, :]
        codes = tl.load(codes_ptr + word[:, :, :, None] * N + n[None, None, None, :], mask=mask, other=0)
        sums = tl.sum(word_dot(codes, x_lo[:, :, :, None], x_hi[:, :, :, None], EMULATE), axis=2)  # [XG, GPX, BN]
        group = k0 // GROUP + tl.arange(0, XG)[:, None] * GPX + tl.arange(0, GPX)[None, :]  # [XG, GPX]
        smask = (group < K // GROUP)[:, :, None] & live[None, None, :]
        sbytes = tl.load(scales_ptr + group[:, :, None] * N + n[None, None, :], mask=smask, other=0)
        scaled = tl.sum(sums.to(tl.float32) * scale_factor(sbytes.to(tl.int32), E8M0), axis=1)  # [XG, BN]
        acc += tl.sum(scaled * d_x[:, None], axis=0)
    if HAS_ROW_SCALES:
        acc *= tl.load(row_scales_ptr + n, mask=live, other=0.0)
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


def int8_gemv_supported(weight: Fp4KernelWeight) -> bool:
    """Whether :func:`fp4_int8_gemv` takes ``weight``: K a whole number of x's 32-input groups."""
    return weight.in_features % 32 == 0


def int8_gemv_config(n: int, k: int, num_sms: int) -> dict:
    """The launch rule: 128-input steps; 4 warps (512 outputs a program) from 16384 outputs, else 1
    (128); K split (up to 32 ways, each split at least two steps) until the warps cover 8 per SM."""
    warps = 4 if n >= 16384 else 1
    block_n = 128 * warps
    steps, split_k = triton.cdiv(k, 128), 1
    while split_k < 32 and triton.cdiv(n, block_n) * split_k * warps < 8 * num_sms and steps >= 4 * split_k:
        split_k *= 2
    return {"KIND": "int8", "BLOCK_N": block_n, "STEP": 128, "SPLIT_K": split_k, "num_warps": warps}


def reserve_counters(device: torch.device) -> Tensor:
    """The device's split counters, allocated (zeroed) on first use: before any CUDA-graph capture
    (the first eager forward does it)."""
    device = torch.device(device)
    if device not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fw_fp4: the int8 GEMV's split counters must be reserved before CUDA-graph capture")
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def fp4_int8_gemv(x: Tensor, weight: Fp4KernelWeight, config: dict) -> Tensor:
    """``x [1, K] @ W.T -> [1, N]`` in ``x.dtype`` (``x`` contiguous) at ``config`` (keys of
    :func:`int8_gemv_config`; ``num_stages`` optional)."""
    assert x.shape[0] == 1 and int8_gemv_supported(weight), (x.shape, weight.in_features)
    n, k = weight.out_features, weight.in_features
    block_n, split_k = config["BLOCK_N"], config["SPLIT_K"]
    assert config["STEP"] % 32 == 0, config
    split_k = max(1, min(split_k, triton.cdiv(k, config["STEP"])))
    blocks = triton.cdiv(n, block_n)
    split = split_k > 1
    if split and blocks > COUNTERS:
        raise ValueError(f"a split FP4 GEMV over {blocks} output blocks needs more than {COUNTERS} counters")
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    partial = torch.empty(split_k, n, dtype=torch.float32, device=x.device) if split else out
    rows = weight.row_scales if weight.row_scales is not None else weight.scales  # unread without row scales
    fp4_int8_gemv_kernel[(blocks, split_k)](
        x,
        weight.codes,
        weight.scales,
        rows,
        out,
        partial,
        reserve_counters(x.device),
        n,
        k,
        split_k,
        GROUP=GROUP_SIZES[weight.fmt],
        E8M0=weight.fmt == "mxfp4",
        HAS_ROW_SCALES=weight.row_scales is not None,
        STEP=config["STEP"],
        BLOCK_N=block_n,
        SPLIT=split,
        EMULATE=emulate(),
        num_warps=config.get("num_warps", 4),
        num_stages=config.get("num_stages", 2),
    )
    return out
