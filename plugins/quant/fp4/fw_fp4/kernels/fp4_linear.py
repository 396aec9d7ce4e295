"""FP4 dense layers on Triton (W4A16): ``out = x @ W.T`` with ``W`` in :mod:`fw_fp4.kernels.layout`
(``codes`` int32 ``[K/8, N]``, one scale byte per group ``[K/G, N]``, NVFP4's fp32 row scales ``[N]``).

Decoding is bit manipulation (``fw_fp4.formats``): a code placed as fp16 bits (``code << 9``) is
its value times 2^-14; an e4m3 byte placed as fp16 bits (``(byte & 0x7f) << 7``) is its value
times 2^-8, so ``code_fp16 * scale_fp16 * 2^22`` is ``e2m1 * e4m3`` exactly (both have few
significant bits), which even bf16 holds exactly. A rebased MXFP4 byte is the fp32 whose exponent
field it is (``byte << 23``). Three forms, by row count (:func:`choose_config`)::

    up to GEMV_MAX_ROWS rows: fp4_gemv_kernel       grid (M, N / BLOCK_N, SPLIT_K), no tensor cores
        per word (8 codes of one output): sum_i e2m1_i * x[8j + i] in fp32, times the word's scale
    up to DEQUANT_MIN_ROWS - 1 rows: fp4_matmul_kernel   grid (N / BLOCK_N, M / BLOCK_M, SPLIT_K)
        w [SUB_K, BLOCK_N] = decode(words, one scale byte per word)      in registers
        acc^T += tl.dot(w^T, x tile^T)                                   tensor cores, fp32 accumulation
    from DEQUANT_MIN_ROWS rows: fp4_dequantize_kernel into a transient [K, N] matrix of x's dtype
        (global scale included), then cuBLAS

One row on CUDA takes the integer GEMV of :mod:`fw_fp4.kernels.fp4_gemv` instead (x rounded to
int8 per 32 inputs, ``dp4a``; :func:`int8_gemv_default`).

In both fused kernels NVFP4's global scale multiplies the fp32 sums once per output (its one rounding). The GEMV
streams each weight byte once per row (the rows of a block run side by side, so their re-reads
hit L2) and keeps every product of a word in one thread; the ``tl.dot`` form follows
``fw_gptq.kernels.wna16``: the weight is the left operand (Hopper's wgmma reads it from registers),
a few rows take 16-row tiles with long K steps. Both split K while the programs are few (float32
partial sums added by the launcher). Grids come from shapes; nothing syncs with the host.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fp4_decode import e2m1, scale_factor
from .fp4_gemv import fp4_int8_gemv, int8_gemv_config, int8_gemv_supported
from .layout import GROUP_SIZES, Fp4KernelWeight

#: Streaming multiprocessors assumed where the device cannot be asked (the interpreter): an H200's.
DEFAULT_NUM_SMS = 132
#: Up to this many rows the tensor-core-free GEMV (one program per row and output block).
GEMV_MAX_ROWS = 2
#: Up to this many rows 16-row ``tl.dot`` tiles with long K steps and split-K to fill the SMs.
DOT_GEMV_MAX_ROWS = 16
#: From this many rows the weight is dequantized once and multiplied by cuBLAS.
DEQUANT_MIN_ROWS = 128


@triton.jit
def _load_words(
    codes_ptr, scales_ptr, ks0, K, offs_n, mask_n, N, GROUP: tl.constexpr, E8M0: tl.constexpr, SUB_K: tl.constexpr
):
    """The code words ``[SUB_K / 8, BLOCK_N]`` of inputs ``ks0 .. ks0 + SUB_K`` (zero past ``K``) and
    each word's scale factor (a group holds whole words: its byte is read per word)."""
    offs_w = ks0 // 8 + tl.arange(0, SUB_K // 8)
    mask = (offs_w[:, None] < K // 8) & mask_n[None, :]
    words = tl.load(codes_ptr + offs_w[:, None] * N + offs_n[None, :], mask=mask, other=0)
    sbytes = tl.load(scales_ptr + (offs_w // (GROUP // 8))[:, None] * N + offs_n[None, :], mask=mask, other=0)
    return words, scale_factor(sbytes.to(tl.int32), E8M0)


@triton.jit
def _decoded_slice(
    codes_ptr,
    scales_ptr,
    ks0,
    K,
    offs_n,
    mask_n,
    N,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    SUB_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``W^T[ks0 : ks0 + SUB_K, offs_n]`` in float32 without the global scale (zero past ``K``)."""
    words, factor = _load_words(codes_ptr, scales_ptr, ks0, K, offs_n, mask_n, N, GROUP, E8M0, SUB_K)
    shifts = tl.arange(0, 8) * 4
    value = e2m1(words[:, None, :] >> shifts[None, :, None])  # [SUB_K / 8, 8, BLOCK_N]
    return tl.reshape(value * factor[:, None, :], (SUB_K, BLOCK_N))


@triton.jit
def fp4_gemv_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    row_scales_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    k_per_split,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    HAS_ROW_SCALES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
):
    """One row of ``x`` times ``BLOCK_N`` outputs over 1/SPLIT_K of K, without tensor cores: each
    thread multiplies the 8 codes of its words by their 8 inputs (all in its registers), then
    scales the word's sum once; the lanes are summed at the end."""
    row, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((SUB_K // 8, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
        for sub in tl.static_range(BLOCK_K // SUB_K):
            ks0 = k0 + sub * SUB_K
            words, factor = _load_words(codes_ptr, scales_ptr, ks0, K, offs_n, mask_n, N, GROUP, E8M0, SUB_K)
            offs_x = ks0 + tl.arange(0, SUB_K // 8) * 8  # input 8j of word j
            per_word = tl.zeros((SUB_K // 8, BLOCK_N), dtype=tl.float32)
            for i in tl.static_range(8):
                x = tl.load(x_ptr + row * stride_xm + offs_x + i, mask=offs_x + i < K, other=0.0).to(tl.float32)
                per_word += e2m1(words >> (4 * i)) * x[:, None]
            acc += per_word * factor
    total = tl.sum(acc, axis=0)
    if HAS_ROW_SCALES:
        total *= tl.load(row_scales_ptr + offs_n, mask=mask_n, other=0.0)
    tl.store(
        out_ptr + pid_k * M * stride_om + row * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=mask_n
    )


@triton.jit
def fp4_matmul_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    row_scales_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    k_per_split,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    HAS_ROW_SCALES: tl.constexpr,
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
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out^T: the weight is the left operand
    k_begin = pid_k * k_per_split  # a split covers whole BLOCK_K steps
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
        for sub in tl.static_range(BLOCK_K // SUB_K):
            ks0 = k0 + sub * SUB_K
            w = _decoded_slice(codes_ptr, scales_ptr, ks0, K, offs_n, mask_n, N, GROUP, E8M0, SUB_K, BLOCK_N)
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
    if HAS_ROW_SCALES:
        acc *= tl.load(row_scales_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
    out = out_ptr + pid_k * M * stride_om + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[None, :] & mask_n[:, None])


@triton.jit
def fp4_dequantize_kernel(
    codes_ptr,
    scales_ptr,
    row_scales_ptr,
    out_ptr,
    N,
    K,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    HAS_ROW_SCALES: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``out [K, N] = W^T`` (global scale included) in ``out``'s dtype; program (block of K, block of N)."""
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    ks0 = pid_k * BLOCK_K
    w = _decoded_slice(codes_ptr, scales_ptr, ks0, K, offs_n, mask_n, N, GROUP, E8M0, BLOCK_K, BLOCK_N)
    if HAS_ROW_SCALES:
        w *= tl.load(row_scales_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    offs_k = ks0 + tl.arange(0, BLOCK_K)
    tl.store(
        out_ptr + offs_k[:, None].to(tl.int64) * N + offs_n[None, :],
        w.to(out_ptr.dtype.element_ty),
        mask=(offs_k < K)[:, None] & mask_n[None, :],
    )


def choose_config(rows: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS) -> dict:
    """Kernel and settings for ``rows`` x ``[n, k]`` (a rule; ``benchmarks/w4a16_kernels.py --variants
    nvfp4 --sweep`` times it beside a grid). Up to :data:`GEMV_MAX_ROWS` rows the tensor-core-free
    GEMV (``KIND: gemv``): 128 outputs a program, 512-input steps of 128-input slices, K split up to
    eight ways while the programs are under four per SM. Up to :data:`DOT_GEMV_MAX_ROWS` rows
    16-row ``tl.dot`` tiles with 512-input steps, K split up to four ways while the output blocks
    fill under half the SMs, 4 stages; more rows 32 or 64-row tiles, one 128-input slice a step, K
    split while the tiles fill under the SMs, 3 stages."""
    sub_k = max(16, min(128, triton.next_power_of_2(k)))
    if rows <= GEMV_MAX_ROWS:
        block_k = max(sub_k, min(512, triton.next_power_of_2(k)))
        programs, split_k = triton.cdiv(n, 128) * rows, 1
        while programs * split_k < 4 * num_sms and k // (split_k * 2) >= block_k and split_k < 8:
            split_k *= 2
        return {
            "KIND": "gemv",
            "BLOCK_N": 128,
            "BLOCK_K": block_k,
            "SUB_K": sub_k,
            "SPLIT_K": split_k,
            "num_warps": 4,
            "num_stages": 3,
        }
    if rows <= DOT_GEMV_MAX_ROWS:
        block_m, block_k, stages, fill = 16, 512, 4, num_sms // 2
    else:
        block_m, block_k, stages, fill = 32 if rows <= 32 else 64, sub_k, 3, num_sms
    block_k = max(sub_k, min(block_k, triton.next_power_of_2(k)))
    programs, split_k = triton.cdiv(n, 128) * triton.cdiv(rows, block_m), 1
    while programs * split_k < fill and k // (split_k * 2) >= max(block_k, 4 * sub_k) and split_k < 4:
        split_k *= 2
    return {
        "KIND": "dot",
        "BLOCK_M": block_m,
        "BLOCK_N": 128,
        "BLOCK_K": block_k,
        "SUB_K": sub_k,
        "SPLIT_K": split_k,
        "num_warps": 4,
        "num_stages": stages,
    }


def _format_args(weight: Fp4KernelWeight) -> dict:
    return dict(GROUP=GROUP_SIZES[weight.fmt], E8M0=weight.fmt == "mxfp4", HAS_ROW_SCALES=weight.row_scales is not None)


def _row_scales(weight: Fp4KernelWeight) -> Tensor:
    return weight.row_scales if weight.row_scales is not None else weight.scales  # unread without row scales


def fp4_dequantize(weight: Fp4KernelWeight, dtype: torch.dtype, block_k: int = 64, block_n: int = 128) -> Tensor:
    """``W^T`` ``[K, N]`` in ``dtype``, the global scale included (one pass over the codes)."""
    k, n = weight.in_features, weight.out_features
    out = torch.empty(k, n, dtype=dtype, device=weight.codes.device)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    fp4_dequantize_kernel[grid](
        weight.codes,
        weight.scales,
        _row_scales(weight),
        out,
        n,
        k,
        BLOCK_K=block_k,
        BLOCK_N=block_n,
        **_format_args(weight),
    )
    return out


def int8_gemv_default(x: Tensor) -> bool:
    """Whether one row takes the integer GEMV (:mod:`fw_fp4.kernels.fp4_gemv`, x rounded to int8 per
    32 inputs) without a forced config: on CUDA unless ``FW_FP4_GEMV=exact``; under the interpreter
    only with ``FW_FP4_GEMV=int8`` (the CPU tests keep the exact kernels' results)."""
    choice = os.environ.get("FW_FP4_GEMV", "")
    if choice not in ("", "int8", "exact"):
        raise ValueError(f"FW_FP4_GEMV={choice!r}; valid: int8, exact (unset: int8 on CUDA)")
    return choice == "int8" or (choice == "" and x.is_cuda)


def fp4_matmul(x: Tensor, weight: Fp4KernelWeight, config: dict | None = None) -> Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in ``x.dtype``. ``config`` (keys of :func:`choose_config`;
    ``KIND`` defaults to ``dot``, a missing ``SUB_K`` is ``min(BLOCK_K, 128)``; ``KIND: int8`` the
    one-row integer GEMV with the keys of :func:`fw_fp4.kernels.fp4_gemv.int8_gemv_config`) forces
    that kernel and setting; without it one row takes the integer GEMV where
    :func:`int8_gemv_default` says so, and :data:`DEQUANT_MIN_ROWS` rows or more go through
    :func:`fp4_dequantize` and cuBLAS."""
    m, k = x.shape
    n = weight.out_features
    assert k == weight.in_features, (x.shape, weight.in_features)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if config is None and m >= DEQUANT_MIN_ROWS:
        return torch.mm(x, fp4_dequantize(weight, x.dtype))
    device_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else DEFAULT_NUM_SMS
    if config is None and m == 1 and int8_gemv_default(x) and int8_gemv_supported(weight):
        config = int8_gemv_config(n, k, device_sms)
    if config is not None and config.get("KIND") == "int8":
        return fp4_int8_gemv(x, weight, config)
    cfg = dict(config or choose_config(m, n, k, device_sms))
    cfg.setdefault("SUB_K", min(cfg["BLOCK_K"], 128))
    kind, split_k = cfg.pop("KIND", "dot"), cfg.pop("SPLIT_K", 1)
    num_warps, num_stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
    assert kind in ("gemv", "dot") and cfg["BLOCK_K"] % cfg["SUB_K"] == 0 and cfg["SUB_K"] % 16 == 0, cfg
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split_k = triton.cdiv(k, k_per_split)
    target = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = target if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    args = (x, weight.codes, weight.scales, _row_scales(weight), partial, m, n, k, x.stride(0), n, k_per_split)
    meta = dict(num_warps=num_warps, num_stages=num_stages, **_format_args(weight), **cfg)
    if kind == "gemv":
        fp4_gemv_kernel[(m, triton.cdiv(n, cfg["BLOCK_N"]), split_k)](*args, **meta)
    else:
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split_k)
        fp4_matmul_kernel[grid](*args, FP32=x.dtype == torch.float32, **meta)
    if split_k > 1:
        target.copy_(partial.sum(0))
    return target
