"""FP4 experts as two grouped GEMMs (:func:`framework.ops.quantized_fused_moe` for types ``"mxfp4"`` and ``"nvfp4"``).

The (token, expert) pairs are grouped by expert into blocks of ``BLOCK_M`` rows as in
``fw_triton_ops.fused_moe`` (one expert per block). Each program streams ``BLOCK_N`` output rows
of its expert, ``BLOCK_K / 2`` bytes of each per step, and decodes them in registers::

    byte j of a row holds features 2j (low nibble) and 2j + 1 (high nibble), group (2j) // G
    w = fp16_bits((code & 8) << 12 | (code & 7) << 9) * factor(scale_byte)        (see fw_fp4.fp4_decode)
    acc += x[:, even features] @ w_low + x[:, odd features] @ w_high               (two tensor-core dots)

MXFP4 (``G = 32``): the scale bytes are e8m0 rebased by +14 at load, ``factor = f32_bits(byte << 23)``.
NVFP4 (``G = 16``): the scale bytes are e4m3, ``factor = fp16_bits(e4m3 placed) * 2^22``; and each
expert's projection has one float32 global scale (``PackedExperts.global_scales``, gate and up
their own), constant along K: it multiplies the accumulator once, after the K loop.

Splitting the dot into even and odd features keeps the decoded tiles in the bytes' order (no
interleave in registers). Kernel 1 computes gate and up (biases added in float32), the activation
(SiLU-and-mul or gpt-oss's clamped SwiGLU), and writes ``act [P, I]``; kernel 2 multiplies by the
down projection, adds its bias and scales by the routing weight; the ``top_k`` rows of a token
are summed in float32. Grids come from shapes only and nothing syncs with the host.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from fw_triton_ops.fused_moe import _block_rows, gate_up_activation, plan_grouped_launch
from torch import Tensor

from framework import ops
from framework.ops import PLAIN_SWIGLU, MoEActivation, PackedExperts

from .fp4_decode import e2m1, scale_factor
from .fp4_moe_gemv import one_token_moe, one_token_supported

#: ``PackedExperts.quant_type`` -> (features per scale byte, scales are rebased e8m0): rows of K/2 bytes.
QUANT_TYPES = {"mxfp4": (32, True), "nvfp4": (16, False)}


@triton.jit
def _fp4_dot(
    acc,
    x_ptr,
    x_rows,
    x_mask,
    stride_x,
    w_ptr,
    s_ptr,
    cols,
    col_mask,
    stride_wn,
    stride_sn,
    k0,
    K,
    BLOCK_K: tl.constexpr,
    CAST_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
):
    """``acc += x[rows, k0:k0+BLOCK_K] @ W[cols, k0:k0+BLOCK_K].T`` with W's rows of FP4 bytes, one
    scale byte per ``GROUP`` features (without the global scale)."""
    half = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte index along the row
    k_mask = half < K // 2
    both = k_mask[:, None] & col_mask[None, :]
    packed = tl.load(w_ptr + cols[None, :] * stride_wn + half[:, None], mask=both, other=0).to(tl.int32)
    scale_bytes = tl.load(s_ptr + cols[None, :] * stride_sn + (half // (GROUP // 2))[:, None], mask=both, other=0)
    scale = scale_factor(scale_bytes.to(tl.int32), E8M0)  # [BLOCK_K / 2, BLOCK_N]
    w_even = e2m1(packed & 15) * scale
    w_odd = e2m1(packed >> 4) * scale
    x_mask2 = x_mask[:, None] & k_mask[None, :]
    x_even = tl.load(x_ptr + x_rows[:, None] * stride_x + 2 * half[None, :], mask=x_mask2, other=0.0)
    x_odd = tl.load(x_ptr + x_rows[:, None] * stride_x + 2 * half[None, :] + 1, mask=x_mask2, other=0.0)
    if CAST_FP32:  # the interpreter computes bf16 wrongly
        acc = tl.dot(x_even.to(tl.float32), w_even, acc, input_precision=PRECISION)
        acc = tl.dot(x_odd.to(tl.float32), w_odd, acc, input_precision=PRECISION)
    else:
        acc = tl.dot(x_even, w_even.to(x_even.dtype), acc)
        acc = tl.dot(x_odd, w_odd.to(x_odd.dtype), acc)
    return acc


@triton.jit
def _fp4_gate_up_kernel(
    x_ptr,
    gate_ptr,
    up_ptr,
    gate_s_ptr,
    up_s_ptr,
    gate_g_ptr,
    up_g_ptr,
    bias_ptr,
    act_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_pairs,
    top_k,
    HIDDEN,
    INTER,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    swiglu_alpha,
    swiglu_limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU_OAI: tl.constexpr,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
):
    expert, pairs, valid = _block_rows(sorted_ids_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    tokens = pairs // top_k
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < INTER
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        acc_gate = _fp4_dot(
            acc_gate,
            x_ptr,
            tokens,
            valid,
            stride_xm,
            gate_ptr + expert * stride_we,
            gate_s_ptr + expert * stride_se,
            cols,
            col_mask,
            stride_wn,
            stride_sn,
            k0,
            HIDDEN,
            BLOCK_K,
            CAST_FP32,
            PRECISION,
            GROUP,
            E8M0,
        )
        acc_up = _fp4_dot(
            acc_up,
            x_ptr,
            tokens,
            valid,
            stride_xm,
            up_ptr + expert * stride_we,
            up_s_ptr + expert * stride_se,
            cols,
            col_mask,
            stride_wn,
            stride_sn,
            k0,
            HIDDEN,
            BLOCK_K,
            CAST_FP32,
            PRECISION,
            GROUP,
            E8M0,
        )
    if HAS_GLOBAL:  # one factor per expert and projection
        acc_gate *= tl.load(gate_g_ptr + expert)
        acc_up *= tl.load(up_g_ptr + expert)
    out_dtype = act_ptr.dtype.element_ty
    act = gate_up_activation(
        acc_gate,
        acc_up,
        bias_ptr,
        expert,
        cols,
        col_mask,
        INTER,
        out_dtype,
        swiglu_alpha,
        swiglu_limit,
        HAS_BIAS,
        SWIGLU_OAI,
    )
    tl.store(
        act_ptr + pairs[:, None] * INTER + cols[None, :], act.to(out_dtype), mask=valid[:, None] & col_mask[None, :]
    )


@triton.jit
def _fp4_down_kernel(
    act_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    bias_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_pairs,
    HIDDEN,
    INTER,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
):
    expert, pairs, valid = _block_rows(sorted_ids_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < HIDDEN
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        acc = _fp4_dot(
            acc,
            act_ptr,
            pairs,
            valid,
            INTER,
            w_ptr + expert * stride_we,
            s_ptr + expert * stride_se,
            cols,
            col_mask,
            stride_wn,
            stride_sn,
            k0,
            INTER,
            BLOCK_K,
            CAST_FP32,
            PRECISION,
            GROUP,
            E8M0,
        )
    if HAS_GLOBAL:
        acc *= tl.load(g_ptr + expert)
    out_dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * HIDDEN + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    routing = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    out = acc.to(out_dtype).to(tl.float32) * routing[:, None]
    tl.store(
        out_ptr + pairs[:, None] * HIDDEN + cols[None, :], out.to(out_dtype), mask=valid[:, None] & col_mask[None, :]
    )


def one_token_default(hidden: Tensor, hidden_size: int, intermediate_size: int, tiles: dict | None) -> bool:
    """Whether one token takes :func:`fw_fp4.kernels.fp4_moe_gemv.one_token_moe` (x rounded to int8
    per 32 inputs): on CUDA without forced ``tiles`` unless ``FW_FP4_GEMV=exact``; under the
    interpreter only with ``FW_FP4_GEMV=int8``."""
    from .fp4_linear import int8_gemv_default

    return tiles is None and int8_gemv_default(hidden) and one_token_supported(hidden_size, intermediate_size)


def _runs_here(hidden: Tensor) -> bool:
    return hidden.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def quantized_fused_moe(
    hidden: Tensor,
    w1: PackedExperts,
    w3: PackedExperts,
    w2: PackedExperts,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: MoEActivation = PLAIN_SWIGLU,
    tiles: dict | None = None,
) -> Tensor:
    """:func:`framework.ops.quantized_fused_moe`; MXFP4 or NVFP4 experts (all three projections of
    one type) here, any other type by the reference. ``tiles`` overrides the launch rule's
    ``BLOCK_N`` / ``BLOCK_K`` / ``num_warps`` / ``num_stages`` (benchmark sweeps; ``BLOCK_M`` stays
    the pairs' block size)."""
    fmt = w1.quant_type
    # GeGLU experts (Gemma 4) take the reference: this kernel's epilogue is SwiGLU's
    if (
        fmt not in QUANT_TYPES
        or any(p.quant_type != fmt for p in (w3, w2))
        or not _runs_here(hidden)
        or activation.gelu_tanh
    ):
        return ops.quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, activation)
    group, e8m0 = QUANT_TYPES[fmt]
    has_global = w1.global_scales is not None
    if any((p.global_scales is not None) != has_global for p in (w3, w2)):
        raise ValueError(f"{fmt} experts: gate, up and down must all have global scales or none")
    formats = dict(GROUP=group, E8M0=e8m0, HAS_GLOBAL=has_global)
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate_size = w1.data.shape[0], w1.data.shape[1]
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(hidden)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    if num_tokens == 1 and one_token_default(hidden, hidden_size, intermediate_size, tiles):
        return one_token_moe(hidden.contiguous(), w1, w3, w2, topk_weights, topk_ids, activation)
    num_pairs = num_tokens * top_k
    sorted_pair_ids, block_expert_ids, num_blocks, block_n, meta = plan_grouped_launch(hidden, topk_ids, num_experts)
    if tiles:
        unknown = set(tiles) - {"BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}
        if unknown:
            raise ValueError(f"tiles {sorted(unknown)}; valid: BLOCK_N, BLOCK_K, num_warps, num_stages")
        meta = {**meta, **tiles}
        block_n = meta["BLOCK_N"]
    w13_bias, w2_bias = activation.w13_bias, activation.w2_bias
    act = torch.empty(num_pairs, intermediate_size, dtype=hidden.dtype, device=hidden.device)
    _fp4_gate_up_kernel[(num_blocks, triton.cdiv(intermediate_size, block_n))](
        hidden,
        w1.data,
        w3.data,
        w1.scales,
        w3.scales,
        w1.global_scales if has_global else w1.scales,
        w3.global_scales if has_global else w3.scales,
        w1.data if w13_bias is None else w13_bias.contiguous(),
        act,
        sorted_pair_ids,
        block_expert_ids,
        num_pairs,
        top_k,
        hidden_size,
        intermediate_size,
        hidden.stride(0),
        w1.data.stride(0),
        w1.data.stride(1),
        w1.scales.stride(0),
        w1.scales.stride(1),
        activation.swiglu_alpha,
        activation.swiglu_limit or 0.0,
        HAS_BIAS=w13_bias is not None,
        SWIGLU_OAI=activation.swiglu_limit is not None,
        **formats,
        **meta,
    )
    per_pair = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _fp4_down_kernel[(num_blocks, triton.cdiv(hidden_size, block_n))](
        act,
        w2.data,
        w2.scales,
        w2.global_scales if has_global else w2.scales,
        w2.data if w2_bias is None else w2_bias.contiguous(),
        per_pair,
        topk_weights.reshape(-1).float(),
        sorted_pair_ids,
        block_expert_ids,
        num_pairs,
        hidden_size,
        intermediate_size,
        w2.data.stride(0),
        w2.data.stride(1),
        w2.scales.stride(0),
        w2.scales.stride(1),
        HAS_BIAS=w2_bias is not None,
        **formats,
        **meta,
    )
    return per_pair.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32).to(hidden.dtype)
