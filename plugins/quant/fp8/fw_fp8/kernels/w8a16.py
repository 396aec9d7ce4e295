"""The W8A16 Triton core: ``out = x @ W.T`` with FP8 ``W`` (:mod:`fw_fp8.kernels.layout`) and 16-bit ``x``.

::

    grid (N / BLOCK_N, M / BLOCK_M, SPLIT_K)      program: BLOCK_M rows x BLOCK_N outputs, 1/SPLIT_K of K
    for each BLOCK_K step of its K range, for each SUB_K slice of it (a slice never crosses a scale column):
        w [BLOCK_N, SUB_K] = qweight[n, k]            (FP8 bytes, upcast to x's dtype in registers: exact)
        s [BLOCK_N]        = scale[n // SCALE_ROWS, k // SCALE_COLS]
        acc^T += tl.dot(w, x tile^T) * s              tensor cores, fp32 accumulation

The weight is the left operand (the output is accumulated transposed): Hopper's wgmma takes that one
from registers, so the upcast bytes go straight into it.

A few rows (the decode GEMV) are padded to ``BLOCK_M = 16`` and go through ``tl.dot`` too: as for the
bf16 GEMV of ``fw_triton_ops`` (:mod:`fw_triton_ops.gemv`), its loads pipeline better than an
elementwise product's, and one row reads the same weight bytes either way. A step covers ``BLOCK_K``
inputs of ``BLOCK_N`` rows (up to 512 bytes a row: ``SUB_K`` 128-input slices against block scales)
and ``num_stages`` steps are in flight, so each program keeps enough bytes in flight to stream HBM.

The scales multiply each slice's partial sums, so the weights are never materialised. With
``SPLIT_K > 1`` each program writes a float32 partial sum; :func:`fw_fp8.kernels.splits.sum_splits`
adds them in a fixed order. No host syncs:
graph-capturable. This is also the path of every batch below sm_89.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import Fp8Weight
from .splits import sum_splits

#: Streaming multiprocessors assumed where the device cannot be asked (the interpreter): an H200's.
DEFAULT_NUM_SMS = 132
#: Up to this many rows the GEMV settings (16-row tiles, long K steps, split-K to fill the SMs).
GEMV_MAX_ROWS = 16


@triton.jit
def w8a16_matmul_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_sn,
    k_per_split,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
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
    scale_row = scale_ptr + (offs_n // SCALE_ROWS) * stride_sn
    # acc is out^T [BLOCK_N, BLOCK_M]: the upcast weight is the left operand, which Hopper's wgmma reads
    # from registers; x's small tile is the right one
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_begin = pid_k * k_per_split  # a split covers whole BLOCK_K steps: only K bounds a step
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
        for sub in tl.static_range(BLOCK_K // SUB_K):
            offs_k = k0 + sub * SUB_K + tl.arange(0, SUB_K)
            mask_k = offs_k < K
            w = tl.load(
                w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0
            )
            scale = tl.load(scale_row + (k0 + sub * SUB_K) // SCALE_COLS, mask=mask_n, other=0.0)
            x_t = tl.load(
                x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None], mask=mask_m[None, :] & mask_k[:, None], other=0.0
            )
            if FP32:
                part = tl.dot(w.to(tl.float32), x_t, input_precision="ieee")
            else:
                part = tl.dot(w.to(x_t.dtype), x_t)
            acc += part * scale[:, None]
    out = out_ptr + pid_k * M * stride_om + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[None, :] & mask_n[:, None])


def choose_config(rows: int, n: int, k: int, scale_cols: int, num_sms: int = DEFAULT_NUM_SMS) -> dict[str, int]:
    """Tile sizes, K step, split-K, warps and stages for ``rows`` x ``[n, k]`` (a rule; the sweep of
    ``benchmarks/fp8_kernels.py --sweep`` times it beside the best of a grid).

    Up to :data:`GEMV_MAX_ROWS` rows: 16-row tiles of 64 outputs, 512-input steps (the bytes a bf16 GEMV
    step of 256 reads), K split in two or four while the N blocks fill under half the SMs, 4 warps,
    4 stages. More rows: 64 x 128 tiles (32 x 64
    up to 32 rows), 128-input steps, K split up to four ways while the tiles fill under the SMs, 3 stages."""
    sub_k = min(128, scale_cols)
    if rows <= GEMV_MAX_ROWS:
        block_n = 64  # x 512 inputs x 4 stages: 192 KB of shared memory with x's tiles (an SM has 227)
        block_k = max(sub_k, min(512, triton.next_power_of_2(k)))
        split_k = 1
        while triton.cdiv(n, block_n) * split_k < num_sms // 2 and k // (split_k * 2) >= block_k and split_k < 4:
            split_k *= 2
        return {
            "BLOCK_M": 16,
            "BLOCK_N": block_n,
            "BLOCK_K": block_k,
            "SUB_K": sub_k,
            "SPLIT_K": split_k,
            "num_warps": 4,
            "num_stages": 4,
        }
    block_m, block_n = (32, 64) if rows <= 32 else (64, 128)
    programs, split_k = triton.cdiv(n, block_n) * triton.cdiv(rows, block_m), 1
    while programs * split_k < num_sms and k // (split_k * 2) >= 4 * sub_k and split_k < 4:
        split_k *= 2
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": sub_k,
        "SUB_K": sub_k,
        "SPLIT_K": split_k,
        "num_warps": 4,
        "num_stages": 3,
    }


def w8a16_matmul(x: torch.Tensor, weight: Fp8Weight, config: dict | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in ``x.dtype`` (fp32 ``x`` multiplies in full fp32: the CPU tests).
    ``config`` (keys of :func:`choose_config`; a missing ``SUB_K`` is ``min(BLOCK_K, 128)``) overrides the
    rule; ``BLOCK_K`` must be a multiple of ``SUB_K``, and ``SUB_K`` divide the scale columns."""
    m, k = x.shape
    n = weight.out_features
    if x.stride(-1) != 1:
        x = x.contiguous()
    scale_cols = weight.scale_cols if weight.scale.shape[1] > 1 else triton.next_power_of_2(k) * 2
    cfg = dict(config or choose_config(m, n, k, scale_cols, _num_sms(x.device)))
    cfg.setdefault("SUB_K", min(cfg["BLOCK_K"], 128))
    split_k = cfg.pop("SPLIT_K", 1)
    num_warps, num_stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
    block_k, sub_k = cfg["BLOCK_K"], cfg["SUB_K"]
    assert block_k % sub_k == 0 and scale_cols % sub_k == 0, (block_k, sub_k, scale_cols)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split_k)
    w8a16_matmul_kernel[grid](
        x,
        weight.qweight,
        weight.scale,
        partial,
        m,
        n,
        k,
        x.stride(0),
        n,
        weight.scale.stride(0),
        k_per_split,
        SCALE_ROWS=weight.scale_rows,
        SCALE_COLS=scale_cols,
        FP32=x.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
        **cfg,
    )
    return out if split_k == 1 else sum_splits(partial, out)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
