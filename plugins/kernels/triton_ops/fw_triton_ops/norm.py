"""RMS norm, alone, fused with the residual add, or gated by ``silu(gate)``: one program normalises one row.

Results match :func:`framework.ops.rms_norm` rounding for rounding: arithmetic in float32 (loads
are cast first; the interpreter computes bf16 wrongly), and the casts to the activation dtype
happen where transformers rounds (see ``_normalise``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fw_triton_ops.activation import _sigmoid

#: A whole row lives in registers; wider rows than this would spill (the widest models are 16k).
MAX_HIDDEN_SIZE = 65536


@triton.jit
def _normalise(x, w, eps, offset, N, OUT_DTYPE: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """``x`` float32 ``[BLOCK_N]`` (zeros where masked) -> the normalised row in float32, rounded as the reference."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    if HAS_OFFSET:  # Gemma: scale by (offset + w) in float32, round once
        return x * rstd * (offset + w)
    # Llama: round the normalised row to the activation dtype, then scale (and round again on store)
    return (x * rstd).to(OUT_DTYPE).to(tl.float32) * w


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, x_row_stride, N, eps, offset, HAS_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    y = _normalise(x, w, eps, offset, N, out_dtype, HAS_OFFSET)
    tl.store(out_ptr + row * N + cols, y.to(out_dtype), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    r_out_ptr,
    x_row_stride,
    r_row_stride,
    N,
    eps,
    offset,
    HAS_OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * r_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    # the sum is rounded to the activation dtype before it is normalised, as the decoder layers do
    s = (x + r).to(out_dtype)
    tl.store(r_out_ptr + row * N + cols, s, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _normalise(s.to(tl.float32), w, eps, offset, N, out_dtype, HAS_OFFSET)
    tl.store(out_ptr + row * N + cols, y.to(out_dtype), mask=mask)


@triton.jit
def _rms_norm_gated_kernel(
    x_ptr, w_ptr, gate_ptr, out_ptr, x_row_stride, gate_row_stride, N, eps, BLOCK_N: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    # the weighted norm is rounded as rms_norm returns it, then gated in float32 and rounded once
    y = _normalise(x, w, eps, 0.0, N, out_dtype, False).to(out_dtype).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (y * (gate * _sigmoid(gate))).to(out_dtype), mask=mask)


def _rows(x: Tensor) -> Tensor:
    """``x`` as ``[rows, hidden]`` with unit column stride (a view when the layout allows)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch_config(hidden_size: int) -> tuple[int, int]:
    if hidden_size > MAX_HIDDEN_SIZE:
        raise ValueError(
            f"triton rms_norm supports hidden sizes up to {MAX_HIDDEN_SIZE}, got {hidden_size}; "
            f"use the torch kernel (FW_KERNELS=rms_norm=torch,fused_add_rms_norm=torch)"
        )
    block_n = triton.next_power_of_2(hidden_size)
    return block_n, min(max(block_n // 256, 1), 8)


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """:func:`framework.ops.rms_norm` in one kernel; returns a new contiguous tensor of ``x``'s shape and dtype."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, hidden_size = _rows(x), x.shape[-1]
    if rows.numel() == 0:
        return out
    block_n, num_warps = _launch_config(hidden_size)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        weight,
        out,
        rows.stride(0),
        hidden_size,
        eps,
        offset,
        HAS_OFFSET=offset != 0.0,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return out


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float = 0.0
) -> tuple[Tensor, Tensor]:
    """:func:`framework.ops.fused_add_rms_norm` in one kernel: ``(rms_norm(x + residual), x + residual)``.

    Both results are new tensors of ``x``'s shape and dtype; the inputs are left untouched.
    """
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x_rows, hidden_size = _rows(x), x.shape[-1]
    r_rows = _rows(residual.expand(x.shape))
    if x_rows.numel() == 0:
        return out, residual_out
    block_n, num_warps = _launch_config(hidden_size)
    _fused_add_rms_norm_kernel[(x_rows.shape[0],)](
        x_rows,
        r_rows,
        weight,
        out,
        residual_out,
        x_rows.stride(0),
        r_rows.stride(0),
        hidden_size,
        eps,
        offset,
        HAS_OFFSET=offset != 0.0,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return out, residual_out


def rms_norm_gated(x: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """:func:`framework.ops_fused.rms_norm_gated` in one kernel; a new contiguous tensor shaped as ``x``."""
    if gate.shape != x.shape:
        raise ValueError(f"rms_norm_gated needs a gate shaped as x {tuple(x.shape)}, got {tuple(gate.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, gate_rows, hidden_size = _rows(x), _rows(gate), x.shape[-1]
    if rows.numel() == 0:
        return out
    block_n, num_warps = _launch_config(hidden_size)
    _rms_norm_gated_kernel[(rows.shape[0],)](
        rows,
        weight,
        gate_rows,
        out,
        rows.stride(0),
        gate_rows.stride(0),
        hidden_size,
        eps,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return out
