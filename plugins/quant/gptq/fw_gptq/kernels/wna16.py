"""The W4A16 / W8A16 Triton core: ``out = x @ W.T`` with ``W`` in :mod:`fw_gptq.kernels.layout`.

Up to :data:`DEQUANT_MIN_ROWS` rows, one fused kernel::

    grid (N / BLOCK_N, M / BLOCK_M, SPLIT_K)      program: BLOCK_M rows x BLOCK_N outputs, 1/SPLIT_K of K
    for each BLOCK_K step of its K range, for each SUB_K slice of it:
        words [SUB_K / pf, BLOCK_N] = qweight[n, k / pf]^T               each 32-bit word loaded once
        q [SUB_K, BLOCK_N] = (words >> (k % pf) * bits) & mask           unpacked in registers (pf = 32 / bits)
        w = ((q - zero[g, n]) * scale[g, n]).to(x.dtype)                 the reference's rounding, exactly
        acc^T += tl.dot(w^T, x tile^T)                                   tensor cores, fp32 accumulation

The weight is the left operand (the output is accumulated transposed): Hopper's wgmma takes that one
from registers, so the words unpack straight into it (``_dequantized_slice`` says how the compiler is
kept on that path).

A few rows (the decode GEMV) are padded to ``BLOCK_M = 16``: as for the bf16 GEMV of ``fw_triton_ops``,
``tl.dot``'s loads pipeline better than an elementwise product's. Steps of up to 512 inputs (256 bytes
a row at 4 bits) and 4 stages keep enough bytes in flight to stream HBM. Scales are loaded once per
slice (one group row) when a slice never crosses a group (``SCALE_PER_SLICE``: no g_idx and ``SUB_K``
divides the group size), else per input feature through ``g_idx``. With ``SPLIT_K > 1`` (few output
blocks) each program writes float32 partial sums that the launcher adds.

More rows (prefill, large batches) are bound by the multiplications, not the weight bytes: the weight
is dequantized into a transient ``[N, K]`` matrix of x's dtype (:func:`wna16_dequantize`, one pass)
and cuBLAS multiplies it. Everything is graph-capturable: no host syncs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .layout import KernelWeight

#: Streaming multiprocessors assumed where the device cannot be asked (the interpreter): an H200's.
DEFAULT_NUM_SMS = 132
#: Up to this many rows the GEMV settings (16-row tiles, long K steps, split-K to fill the SMs).
GEMV_MAX_ROWS = 16
#: From this many rows the weight is dequantized once and multiplied by cuBLAS.
DEQUANT_MIN_ROWS = 128
#: The kernels that can multiply one row on CUDA: the integer GEMV of :mod:`~fw_gptq.kernels.gemv_int8`
#: (x rounded to int8 per 32 inputs) or this module's tile kernel (x as it is).
GEMV_CHOICES = ("int8", "tile")
#: The one-row kernel when ``FW_GPTQ_GEMV`` is unset (one constant to flip after a GPU timing).
DEFAULT_GEMV = "int8"


@triton.jit
def _dequantized_slice(
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    g_idx_ptr,
    ks0,
    k_end,
    offs_n,
    mask_n,
    N,
    stride_qn,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    SCALE_PER_SLICE: tl.constexpr,
    SUB_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``W^T[ks0 : ks0 + SUB_K, offs_n]`` in float32, ``(q - zero) * scale`` exactly (zero where
    ``k >= k_end`` or masked out): the reference's values before the cast to the activations' dtype.
    ``stride_qn``: words a row of ``qweight`` (``K / pf``); ``ks0`` a multiple of ``SUB_K``.

    The words are loaded as ``[SUB_K / pf, BLOCK_N]`` (each column a contiguous run of its row) and
    unpacked along K: the transposed orientation keeps the unpacked values in the registers of the
    dot's left operand (loading ``[BLOCK_N, SUB_K / pf]`` sends them through shared memory, sm_90 PTX).

    No integer-to-float conversion runs (a quarter-rate instruction on Hopper, which would bound the
    GEMV): a quant ORed into the bits of 2**23 is ``2**23 + q`` as a float32, ``(2**23 + q) - (2**23 +
    zero)`` is exact, and the multiplication by the scale is exact too (a few bits times a 16-bit scale).
    The zero is a tensor even for symmetric weights: with a constant, Triton (3.6) sends the values
    through shared memory instead of unpacking the words in the dot operand's registers (PTX of the
    sm_90 compile)."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    BIASED_ZERO: tl.constexpr = 8388608.0 + (1 << (BITS - 1))
    # ks0 is a multiple of SUB_K: said, the row's words are copied 16 bytes at a time
    offs_w = tl.multiple_of(ks0 // PACK, SUB_K // PACK) + tl.arange(0, SUB_K // PACK)
    words = tl.load(
        qweight_ptr + offs_w[:, None] + offs_n[None, :] * stride_qn,
        mask=(offs_w[:, None] < stride_qn) & mask_n[None, :],  # stride_qn = K / pf, known divisible by 16
        other=0,
    )
    shifts = tl.arange(0, PACK) * BITS
    q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & MASK, (SUB_K, BLOCK_N))
    biased = (q | 0x4B000000).to(tl.float32, bitcast=True)
    if SCALE_PER_SLICE:
        group = ks0 // GROUP_SIZE
        scale = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    else:
        offs_k = ks0 + tl.arange(0, SUB_K)
        mask_k = offs_k < k_end
        if HAS_G_IDX:
            groups = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
        else:
            groups = offs_k // GROUP_SIZE
        at = groups[:, None] * N + offs_n[None, :]
        both = mask_k[:, None] & mask_n[None, :]
        scale = tl.load(scales_ptr + at, mask=both, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + at, mask=both, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        biased_zero = zero + 8388608.0
    else:
        biased_zero = scale * 0.0 + BIASED_ZERO
    return (biased - biased_zero) * scale


@triton.jit
def wna16_matmul_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    g_idx_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_qn,
    stride_xm,
    stride_om,
    k_per_split,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    SCALE_PER_SLICE: tl.constexpr,
    FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    # acc is out^T [BLOCK_N, BLOCK_M]: the dequantized weight is the left operand, which Hopper's wgmma
    # reads from registers (no round trip through shared memory); x's small tile is the right one
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_begin = pid_k * k_per_split  # a split covers whole BLOCK_K steps: only K bounds a step
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
        for sub in tl.static_range(BLOCK_K // SUB_K):
            ks0 = k0 + sub * SUB_K
            w = _dequantized_slice(
                qweight_ptr,
                scales_ptr,
                zeros_ptr,
                g_idx_ptr,
                ks0,
                K,
                offs_n,
                mask_n,
                N,
                stride_qn,
                BITS,
                GROUP_SIZE,
                HAS_ZEROS,
                HAS_G_IDX,
                SCALE_PER_SLICE,
                SUB_K,
                BLOCK_N,
            )
            offs_k = ks0 + tl.arange(0, SUB_K)
            x_t = tl.load(
                x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                mask=mask_m[None, :] & (offs_k < K)[:, None],
                other=0.0,
            )
            if FP32:
                acc += tl.dot(tl.trans(w), x_t, input_precision="ieee")
            else:
                acc += tl.dot(tl.trans(w).to(x_t.dtype), x_t)
    out = out_ptr + pid_k * M * stride_om + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[None, :] & mask_n[:, None])


@triton.jit
def wna16_dequantize_kernel(
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    g_idx_ptr,
    out_ptr,
    N,
    K,
    stride_qn,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    SCALE_PER_SLICE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``out [N, K] = W`` in ``out``'s dtype; program (block of K, block of N)."""
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    ks0 = pid_k * BLOCK_K
    w = _dequantized_slice(
        qweight_ptr,
        scales_ptr,
        zeros_ptr,
        g_idx_ptr,
        ks0,
        K,
        offs_n,
        mask_n,
        N,
        stride_qn,
        BITS,
        GROUP_SIZE,
        HAS_ZEROS,
        HAS_G_IDX,
        SCALE_PER_SLICE,
        BLOCK_K,
        BLOCK_N,
    )
    offs_k = ks0 + tl.arange(0, BLOCK_K)
    tl.store(
        out_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None],
        w.to(out_ptr.dtype.element_ty),
        mask=(offs_k < K)[:, None] & mask_n[None, :],
    )


def choose_config(
    rows: int, n: int, k: int, group_size: int, num_sms: int = DEFAULT_NUM_SMS, bits: int = 4
) -> dict[str, int]:
    """Tile sizes, K step, split-K, warps and stages for ``rows`` x ``[n, k]`` (a rule; the sweep in
    ``benchmarks/w4a16_kernels.py`` times it beside the best of a grid).

    128 outputs a tile. Up to :data:`GEMV_MAX_ROWS` rows: 16-row tiles, 512-input steps (256 at 8 bits,
    to fit the shared memory) of 128-input slices (the group, where it is smaller), K split up to four ways while the N blocks fill under half
    the SMs, 4 warps, 4 stages. More rows: 32 or 64-row tiles, one slice a step, K split while the tiles
    fill under the SMs, 3 stages."""
    sub_k = min(128, group_size) if group_size > 0 else 128
    sub_k = max(sub_k, 16)  # tl.dot's smallest K; a smaller group reads its scales per input
    if rows <= GEMV_MAX_ROWS:  # 4 stages of 128 x 512 4-bit words (or x 256 8-bit ones) and x: 192 / 160 KB
        block_m, block_k, stages, fill = 16, 2048 // bits, 4, num_sms // 2
    else:
        block_m, block_k, stages, fill = 32 if rows <= 32 else 64, sub_k, 3, num_sms
    block_n = 128  # narrower tiles make Triton (3.6) route the unpacked weights through shared memory
    block_k = max(sub_k, min(block_k, triton.next_power_of_2(k)))
    programs, split_k = triton.cdiv(n, block_n) * triton.cdiv(rows, block_m), 1
    while programs * split_k < fill and k // (split_k * 2) >= max(block_k, 4 * sub_k) and split_k < 4:
        split_k *= 2
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "SUB_K": sub_k,
        "SPLIT_K": split_k,
        "num_warps": 4,
        "num_stages": stages,
    }


def _scale_per_slice(weight: KernelWeight, sub_k: int) -> bool:
    return weight.g_idx is None and weight.group_size % sub_k == 0


def _launch_args(weight: KernelWeight, sub_k: int) -> dict:
    return dict(
        BITS=weight.bits,
        GROUP_SIZE=weight.group_size,
        HAS_ZEROS=weight.zeros is not None,
        HAS_G_IDX=weight.g_idx is not None,
        SCALE_PER_SLICE=_scale_per_slice(weight, sub_k),
    )


def _pointers(weight: KernelWeight) -> tuple:
    return (
        weight.qweight,
        weight.scales,
        weight.zeros if weight.zeros is not None else weight.scales,
        weight.g_idx if weight.g_idx is not None else weight.qweight,
    )


def wna16_dequantize(weight: KernelWeight, dtype: torch.dtype, block_k: int = 128, block_n: int = 64) -> torch.Tensor:
    """``W`` ``[N, K]`` in ``dtype``, in the kernel's (act-order permuted) input order: the same values as
    :func:`~fw_gptq.kernels.layout.dequantize_kernel_weight` with ``permuted=True``."""
    k, n = weight.in_features, weight.out_features
    out = torch.empty(n, k, dtype=dtype, device=weight.qweight.device)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    wna16_dequantize_kernel[grid](
        *_pointers(weight),
        out,
        n,
        k,
        weight.qweight.stride(0),
        BLOCK_K=block_k,
        BLOCK_N=block_n,
        **_launch_args(weight, block_k),
    )
    return out


def wna16_matmul(
    x: torch.Tensor, weight: KernelWeight, out: torch.Tensor | None = None, config: dict | None = None
) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in ``x.dtype`` (``out``: where to write it); ``x`` in the layer's
    input order (the act-order permutation is applied here). ``config`` (keys of :func:`choose_config`;
    a missing ``SUB_K`` is ``min(BLOCK_K, 128)``) forces the fused kernel with that setting; without
    it, :data:`DEQUANT_MIN_ROWS` rows or more go through :func:`wna16_dequantize` and cuBLAS."""
    m, k = x.shape
    n = weight.out_features
    if weight.perm is not None:
        x = x.index_select(1, weight.perm)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if config is None and m == 1 and int8_gemv_chosen(weight, x):
        from .gemv_int8 import int8_gemv

        return int8_gemv(x, weight, out)
    if config is None and m >= DEQUANT_MIN_ROWS:
        product = torch.mm(x, wna16_dequantize(weight, x.dtype).t())
        if out is None:
            return product
        out.copy_(product)
        return out
    cfg = dict(config or choose_config(m, n, k, weight.group_size, _num_sms(x.device), weight.bits))
    cfg.setdefault("SUB_K", min(cfg["BLOCK_K"], 128))
    split_k = cfg.pop("SPLIT_K", 1)
    num_warps, num_stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
    block_k, sub_k = cfg["BLOCK_K"], cfg["SUB_K"]
    assert block_k % sub_k == 0 and sub_k % (32 // weight.bits) == 0, (block_k, sub_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    target = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = target if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split_k)
    wna16_matmul_kernel[grid](
        x,
        *_pointers(weight),
        partial,
        m,
        n,
        k,
        weight.qweight.stride(0),
        x.stride(0),
        n if split_k > 1 else target.stride(0),
        k_per_split,
        FP32=x.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
        **_launch_args(weight, sub_k),
        **cfg,
    )
    if split_k > 1:
        target.copy_(partial.sum(0))
    return target


def gemv_choice() -> str:
    """Which kernel multiplies one row on CUDA: ``FW_GPTQ_GEMV`` (``int8`` or ``tile``), else
    :data:`DEFAULT_GEMV`. An unknown value is an error naming the valid ones."""
    choice = os.environ.get("FW_GPTQ_GEMV", "") or DEFAULT_GEMV
    if choice not in GEMV_CHOICES:
        raise ValueError(f"FW_GPTQ_GEMV={choice!r}: valid values are {', '.join(GEMV_CHOICES)}")
    return choice


def int8_gemv_chosen(weight: KernelWeight, x: torch.Tensor) -> bool:
    """Whether one row goes to the integer GEMV (:mod:`~fw_gptq.kernels.gemv_int8`: x rounded to int8
    per 32 inputs, as llama.cpp's GPU GEMV): on CUDA, in bf16/fp16, for a weight it takes, when
    :func:`gemv_choice` is ``int8``."""
    if x.device.type != "cuda" or gemv_choice() != "int8":
        return False
    from .gemv_int8 import int8_gemv_supported

    return x.dtype in (torch.bfloat16, torch.float16) and int8_gemv_supported(weight)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
