"""Gated activations ``act(gate) * up`` over ``[..., 2 * d]`` (gate then up) in one kernel.

The activation is rounded to the output dtype before the product, as the reference (and the
Hugging Face MLPs, ``act_fn(gate_proj(x)) * up_proj(x)``) rounds it; in float32 that is a no-op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

#: Columns per program; wider rows take several programs along the grid's second axis.
BLOCK_D = 1024


@triton.jit
def _sigmoid(z):
    # exp of a non-positive argument only: no overflow for large |z| (and no interpreter warnings)
    e = tl.exp(-tl.abs(z))
    return tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, x_row_stride, D, IS_GELU_TANH: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + D + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_GELU_TANH:
        # 0.5 * g * (1 + tanh(z)) == g * sigmoid(2z), z = sqrt(2/pi) * (g + 0.044715 g^3);
        # the sigmoid form has no cancellation for negative g
        act = gate * _sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
    else:
        act = gate * _sigmoid(gate)
    out_dtype = out_ptr.dtype.element_ty
    out = act.to(out_dtype).to(tl.float32) * up
    tl.store(out_ptr + row * D + cols, out.to(out_dtype), mask=mask)


def _act_and_mul(x: Tensor, is_gelu_tanh: bool) -> Tensor:
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if out.numel() == 0:
        return out
    block_d = min(BLOCK_D, triton.next_power_of_2(d))
    # rows on the first axis: it allows 2**31 - 1 programs, the second only 65535
    grid = (rows.shape[0], triton.cdiv(d, block_d))
    _act_and_mul_kernel[grid](
        rows, out, rows.stride(0), d, IS_GELU_TANH=is_gelu_tanh, BLOCK_D=block_d, num_warps=4 if block_d >= 512 else 2
    )
    return out


def silu_and_mul(x: Tensor) -> Tensor:
    """:func:`framework.ops.silu_and_mul`: ``silu(gate) * up``, a new ``[..., d]`` tensor of ``x``'s dtype."""
    return _act_and_mul(x, is_gelu_tanh=False)


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """:func:`framework.ops.gelu_tanh_and_mul`: ``gelu_tanh(gate) * up``, a new ``[..., d]`` tensor."""
    return _act_and_mul(x, is_gelu_tanh=True)
