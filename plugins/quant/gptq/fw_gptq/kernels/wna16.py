"""The W4A16 / W8A16 Triton core: ``out = x @ W.T`` with ``W`` in :mod:`fw_gptq.kernels.layout`.

One kernel, two inner products chosen at compile time::

    grid (N / BLOCK_N, M / BLOCK_M, SPLIT_K)      program: BLOCK_M rows x BLOCK_N outputs, 1/SPLIT_K of K
    for each BLOCK_K slice of its K range:
        words [BLOCK_K, BLOCK_N] = qweight[k // pf, n]        (rows of N contiguous int32)
        w = ((words >> (k % pf) * bits) & mask - zero[g, n]) * scale[g, n]      (float32)
        USE_DOT:  acc += tl.dot(x tile, w)          tensor cores, BLOCK_M >= 16 (many rows)
        else:     acc += sum_k x[m, k] * w[k, n]    CUDA cores, BLOCK_M <= 4 (decode GEMV)

Scales are loaded once per slice (one group row) when a slice never crosses a group
(``SCALE_PER_SLICE``: no g_idx and BLOCK_K divides the group size), else per input feature through
``g_idx``. With ``SPLIT_K > 1`` (few output blocks: small N, or few rows) each program writes a
float32 partial sum and the launcher adds them. Everything is graph-capturable: no host syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import KernelWeight

#: Streaming multiprocessors to fill (an H100/H200 has 132); split-K aims for two programs each.
TARGET_PROGRAMS = 264
#: Up to this many rows use the CUDA-core GEMV form; more use tensor-core tiles.
GEMV_MAX_ROWS = 4


@triton.jit
def wna16_matmul_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr,
                        M, N, K, stride_xm, stride_om, k_per_split,
                        BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr,
                        HAS_G_IDX: tl.constexpr, SCALE_PER_SLICE: tl.constexpr, USE_DOT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    ZERO: tl.constexpr = 1 << (BITS - 1)
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        words = tl.load(qweight_ptr + (offs_k // PACK)[:, None] * N + offs_n[None, :],
                        mask=mask_k[:, None] & mask_n[None, :], other=0)
        q = ((words >> ((offs_k % PACK) * BITS)[:, None]) & MASK).to(tl.float32)
        if SCALE_PER_SLICE:
            group = k0 // GROUP_SIZE
            scale = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if HAS_ZEROS:
                zero = tl.load(zeros_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            else:
                zero = ZERO
        else:
            if HAS_G_IDX:
                groups = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
            else:
                groups = offs_k // GROUP_SIZE
            at = groups[:, None] * N + offs_n[None, :]
            both = mask_k[:, None] & mask_n[None, :]
            scale = tl.load(scales_ptr + at, mask=both, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                zero = tl.load(zeros_ptr + at, mask=both, other=0.0).to(tl.float32)
            else:
                zero = ZERO
        w = (q - zero) * scale  # [BLOCK_K, BLOCK_N]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        if USE_DOT:
            acc += tl.dot(x, w.to(x.dtype))
        else:
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    out = out_ptr + pid_k * M * stride_om + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def choose_config(rows: int, n: int, k: int, group_size: int) -> dict[str, int | bool]:
    """Block sizes, split-K and the inner product for ``rows`` x ``[n, k]`` (a heuristic; the sweep in
    ``benchmarks/w4a16_kernels.py`` measures it)."""
    use_dot = rows > GEMV_MAX_ROWS
    block_m = triton.next_power_of_2(rows) if not use_dot else min(64, max(16, triton.next_power_of_2(rows)))
    block_n = 64 if use_dot else 128
    block_k = 64 if use_dot else 32
    programs = triton.cdiv(n, block_n) * triton.cdiv(rows, block_m)
    split_k = 1
    while programs * split_k * 2 <= TARGET_PROGRAMS and k // (split_k * 2) >= 4 * block_k:
        split_k *= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": min(block_k, group_size) if group_size > 0 else block_k,
            "SPLIT_K": split_k, "USE_DOT": use_dot}


def wna16_matmul(x: torch.Tensor, weight: KernelWeight, out: torch.Tensor | None = None,
                 config: dict | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in ``x.dtype`` (``out``: where to write it); ``x`` in the layer's
    input order (the act-order permutation is applied here)."""
    m, k = x.shape
    n = weight.out_features
    if weight.perm is not None:
        x = x.index_select(1, weight.perm)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = dict(config or choose_config(m, n, k, weight.group_size))
    split_k = cfg.pop("SPLIT_K")
    num_warps, num_stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 2 if cfg["USE_DOT"] else 3)
    block_k = cfg["BLOCK_K"]
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    target = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = target if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split_k)
    scale_per_slice = weight.g_idx is None and weight.group_size % block_k == 0
    wna16_matmul_kernel[grid](
        x, weight.qweight, weight.scales, weight.zeros if weight.zeros is not None else weight.scales,
        weight.g_idx if weight.g_idx is not None else weight.qweight, partial,
        m, n, k, x.stride(0), n if split_k > 1 else target.stride(0), k_per_split,
        BITS=weight.bits, GROUP_SIZE=weight.group_size, HAS_ZEROS=weight.zeros is not None,
        HAS_G_IDX=weight.g_idx is not None, SCALE_PER_SLICE=scale_per_slice, SPLIT_K=split_k,
        num_warps=num_warps, num_stages=num_stages, **cfg)
    if split_k > 1:
        target.copy_(partial.sum(0))
    return target
