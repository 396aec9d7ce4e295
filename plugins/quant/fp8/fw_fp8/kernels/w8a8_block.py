"""The W8A8 Triton GEMM: activations quantized to FP8 per token and group of ``GROUP`` (128) inputs, then
``tl.dot`` on FP8 operands (tensor cores from sm_89) with both scales applied per K block.

::

    quantize_activations:  x [M, K] -> q float8_e4m3fn [M, K], s float32 [M, ceil(K / GROUP)]
                           s[m, g] = max |x[m, g*GROUP:(g+1)*GROUP]| / 448,   q = x / s
    w8a8_block_matmul:     grid (N / BLOCK_N, M / BLOCK_M), BLOCK_K = GROUP
        acc += tl.dot(q tile, W tile.T) * s[m, kb] * scale[n // SCALE_ROWS, kb * GROUP // SCALE_COLS]

The weight is :mod:`fw_fp8.kernels.layout`'s (block scales, or one column for channel / tensor
weights). No host syncs: graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quantize import FP8_DTYPE, FP8_MAX
from .layout import Fp8Weight

#: Inputs per activation scale (DeepSeek's 1x128 groups); the GEMM's BLOCK_K.
GROUP = 128
#: The smallest group maximum (an all-zero group).
MIN_AMAX = 1e-10


@triton.jit
def quantize_activations_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, num_groups, GROUP: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr
):
    row, group = tl.program_id(0), tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX) / FP8_MAX
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * num_groups + group, scale)


def quantize_activations(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, K] float8_e4m3fn, s [M, ceil(K / group)] float32)`` with ``x ~= q * s`` per group.

    On the CPU this is the torch reference: the Triton interpreter's float-to-FP8 conversion
    mis-rounds values that round up into the next binade (0.49 -> 0.25), GPUs convert correctly."""
    if x.device.type == "cpu":
        return quantize_activations_reference(x, group)
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        quantize_activations_kernel[(m, groups)](
            x, q, s, k, x.stride(0), groups, GROUP=group, FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX
        )
    return q, s


def quantize_activations_reference(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`quantize_activations`."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    tiles = padded.view(m, groups, group)
    s = tiles.abs().amax(-1).clamp_min(MIN_AMAX) / FP8_MAX
    q = (tiles / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, -1)[:, :k]
    return q.contiguous(), s


@triton.jit
def w8a8_block_matmul_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_om,
    stride_sn,
    num_groups,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    scale_row = scale_ptr + (offs_n // SCALE_ROWS) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, num_groups):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptr + offs_m * num_groups + kb, mask=mask_m, other=0.0)
        w_scale = tl.load(scale_row + (kb * BLOCK_K) // SCALE_COLS, mask=mask_n, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * a_scale[:, None] * w_scale[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def choose_config(rows: int, n: int) -> dict[str, int]:
    """Tile sizes for ``rows`` x ``n`` outputs (a heuristic; ``benchmarks/fp8_kernels.py`` sweeps it)."""
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": 128 if block_m >= 64 else 64,
        "num_warps": 8 if block_m >= 128 else 4,
        "num_stages": 3,
    }


def w8a8_block_matmul(x: torch.Tensor, weight: Fp8Weight, config: dict | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in ``x.dtype``, ``x`` quantized per token and group of 128 inputs."""
    m, k = x.shape
    n = weight.out_features
    if x.stride(-1) != 1:
        x = x.contiguous()
    q, s = quantize_activations(x)
    scale_cols = weight.scale_cols if weight.scale.shape[1] > 1 else triton.next_power_of_2(k) * 2
    assert scale_cols % GROUP == 0, scale_cols
    cfg = dict(config or choose_config(m, n))
    num_warps, num_stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    w8a8_block_matmul_kernel[grid](
        q,
        s,
        weight.qweight,
        weight.scale,
        out,
        m,
        n,
        k,
        out.stride(0),
        weight.scale.stride(0),
        s.shape[1],
        SCALE_ROWS=weight.scale_rows,
        SCALE_COLS=scale_cols,
        BLOCK_K=GROUP,
        num_warps=num_warps,
        num_stages=num_stages,
        **cfg,
    )
    return out
