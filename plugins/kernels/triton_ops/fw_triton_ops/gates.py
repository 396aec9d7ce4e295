"""Sigmoid gates in one launch each: :func:`framework.ops_fused.sigmoid_gate_mul` (gated attention
outputs, shared experts) and :func:`framework.ops_linear_attention.gdn_gating` (a Gated DeltaNet
layer's decay and write strength).

Arithmetic in float32 after the loads; the results are rounded where the torch chains round
(``sigmoid_gate_mul``: after the sigmoid, the product and the sum). The gates are read through
their strides (the gate half of a query projection is a view), so nothing is copied first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from framework.ops_fused import sigmoid_gate_mul as reference_sigmoid_gate_mul
from fw_triton_ops.activation import _sigmoid

#: Columns per program of ``sigmoid_gate_mul``; wider rows take several programs.
BLOCK_N = 1024


@triton.jit
def _sigmoid_gate_mul_kernel(
    x_ptr,
    gate_ptr,
    residual_ptr,
    out_ptr,
    N,
    stride_x,
    stride_gate_t,
    stride_gate_h,
    stride_residual,
    GATE_HEAD: tl.constexpr,
    BROADCAST: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if BROADCAST:  # one gate per row
        gate = tl.load(gate_ptr + row * stride_gate_t).to(tl.float32)
    else:  # column c is feature c % GATE_HEAD of gate head c // GATE_HEAD
        offsets = (cols // GATE_HEAD) * stride_gate_h + cols % GATE_HEAD
        gate = tl.load(gate_ptr + row * stride_gate_t + offsets, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    out = (x * _sigmoid(gate).to(dtype).to(tl.float32)).to(dtype)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        out = (residual + out.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * N + cols, out, mask=mask)


def sigmoid_gate_mul(x: Tensor, gate: Tensor, residual: Tensor | None = None) -> Tensor:
    """:func:`framework.ops_fused.sigmoid_gate_mul` in one launch; a new contiguous ``[T, N]`` tensor.
    Mixed dtypes (which the torch chain would promote) take the reference."""
    if x.dim() != 2 or gate.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        return reference_sigmoid_gate_mul(x, gate, residual)
    num_tokens, width = x.shape
    out = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    broadcast = gate.shape[-1] == 1 and gate.numel() == num_tokens
    if gate.dim() == 2:
        gate = gate.unsqueeze(1)  # [T, 1, N]: one head
    if not broadcast and (gate.dim() != 3 or gate.shape[1] * gate.shape[2] != width or gate.stride(-1) != 1):
        gate = gate.reshape(num_tokens, 1, width).contiguous()
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    block_n = min(BLOCK_N, triton.next_power_of_2(width))
    _sigmoid_gate_mul_kernel[(num_tokens, triton.cdiv(width, block_n))](
        x,
        gate,
        x if residual is None else residual,
        out,
        width,
        x.stride(0),
        gate.stride(0),
        gate.stride(1),
        0 if residual is None else residual.stride(0),
        GATE_HEAD=gate.shape[-1],
        BROADCAST=broadcast,
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block_n,
        num_warps=4 if block_n >= 512 else 1,
    )
    return out


@triton.jit
def _softplus(x):
    """``F.softplus`` (threshold 20): ``log1p(exp(x))``, with log1p exact for small arguments
    (``log(u) * y / (u - 1)`` with ``u = 1 + y``: the rounding of ``u`` cancels)."""
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _gdn_gating_kernel(
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    g_ptr,
    beta_ptr,
    stride_a,
    stride_b,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    mask = h < NUM_HEADS
    a = tl.load(a_ptr + row * stride_a + h, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + h, mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + h, mask=mask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h, mask=mask, other=0.0).to(tl.float32)
    g = -tl.exp(a_log) * _softplus(a + dt_bias)
    tl.store(g_ptr + row * NUM_HEADS + h, g, mask=mask)
    tl.store(beta_ptr + row * NUM_HEADS + h, _sigmoid(b).to(beta_ptr.dtype.element_ty), mask=mask)


def gdn_gating(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:  # noqa: N803
    """:func:`framework.ops_linear_attention.gdn_gating` in one launch: ``(g float32, beta)`` ``[T, H]``."""
    num_tokens, num_heads = a.shape
    g = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(num_tokens, num_heads, dtype=b.dtype, device=b.device)
    if num_tokens == 0:
        return g, beta
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    _gdn_gating_kernel[(num_tokens,)](
        a, b, A_log, dt_bias, g, beta, a.stride(0), b.stride(0),
        NUM_HEADS=num_heads, BLOCK_H=triton.next_power_of_2(num_heads), num_warps=1,
    )  # fmt: skip
    return g, beta
