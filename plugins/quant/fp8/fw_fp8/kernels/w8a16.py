"""The W8A16 Triton core: ``out = x @ W.T`` with FP8 ``W`` (:mod:`fw_fp8.kernels.layout`) and 16-bit ``x``.

::

    grid (N / BLOCK_N, M / BLOCK_M, SPLIT_K)      program: BLOCK_M rows x BLOCK_N outputs, 1/SPLIT_K of K
    for each BLOCK_K slice of its K range (never across a scale column):
        w [BLOCK_N, BLOCK_K] = qweight[n, k]  (FP8 bytes, upcast in registers)
        s [BLOCK_N]          = scale[n // SCALE_ROWS, k0 // SCALE_COLS]
        USE_DOT:  acc += tl.dot(x tile, w.T) * s          tensor cores (16-bit), many rows
        else:     acc += (sum_k x[m, k] * w[n, k]) * s    CUDA cores, the decode GEMV

The scales multiply each slice's partial sums (the epilogue of a slice), so the weights are never
materialised. With ``SPLIT_K > 1`` each program writes a float32 partial sum that the launcher
adds. No host syncs: graph-capturable. This is also the path of every batch below sm_89.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import Fp8Weight

#: Programs to aim for (two per SM of an H100/H200); split-K fills them when N is small.
TARGET_PROGRAMS = 264
#: Up to this many rows the CUDA-core GEMV form; more use tensor-core tiles.
GEMV_MAX_ROWS = 8


@triton.jit
def w8a16_matmul_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_om, stride_sn, k_per_split,
                        SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, USE_DOT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    scale_row = scale_ptr + (offs_n // SCALE_ROWS) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        scale = tl.load(scale_row + k0 // SCALE_COLS, mask=mask_n, other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        if USE_DOT:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
        else:
            part = tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        acc += part * scale[None, :]
    out = out_ptr + pid_k * M * stride_om + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def choose_config(rows: int, n: int, k: int, scale_cols: int) -> dict[str, int | bool]:
    """Block sizes, split-K and the inner product for ``rows`` x ``[n, k]`` (a heuristic; the sweep in
    ``benchmarks/fp8_kernels.py`` measures it)."""
    use_dot = rows > GEMV_MAX_ROWS
    block_m = triton.next_power_of_2(rows) if not use_dot else min(64, max(16, triton.next_power_of_2(rows)))
    block_n = 64 if use_dot or rows == 1 else (32 if rows <= 4 else 16)  # GEMV: BLOCK_M * BLOCK_N * BLOCK_K in registers
    block_k = 128 if not use_dot or scale_cols % 128 == 0 else 64
    while scale_cols % block_k and block_k > 16:  # a slice must not cross a scale column
        block_k //= 2
    programs = triton.cdiv(n, block_n) * triton.cdiv(rows, block_m)
    split_k = 1
    while programs * split_k * 2 <= TARGET_PROGRAMS and k // (split_k * 2) >= 4 * block_k:
        split_k *= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "USE_DOT": use_dot}


def w8a16_matmul(x: torch.Tensor, weight: Fp8Weight, config: dict | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in ``x.dtype``."""
    m, k = x.shape
    n = weight.out_features
    if x.stride(-1) != 1:
        x = x.contiguous()
    scale_cols = weight.scale_cols if weight.scale.shape[1] > 1 else triton.next_power_of_2(k) * 2
    cfg = dict(config or choose_config(m, n, k, scale_cols))
    split_k = cfg.pop("SPLIT_K")
    num_warps, num_stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 2 if cfg["USE_DOT"] else 3)
    block_k = cfg["BLOCK_K"]
    assert scale_cols % block_k == 0, (scale_cols, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split_k)
    w8a16_matmul_kernel[grid](x, weight.qweight, weight.scale, partial, m, n, k, x.stride(0), n, weight.scale.stride(0),
                              k_per_split, SCALE_ROWS=weight.scale_rows, SCALE_COLS=scale_cols,
                              num_warps=num_warps, num_stages=num_stages, **cfg)
    if split_k > 1:
        out.copy_(partial.sum(0))
    return out
