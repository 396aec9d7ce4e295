"""Decode-step kernels of gated-delta-net layers: the recurrent state update and the short conv.

Same signatures and results as :func:`framework.ops_linear_attention.gated_delta_rule` and
:func:`~framework.ops_linear_attention.causal_conv1d`. The one-token sequences of a step (decode)
run here, each program reading and writing its sequence's state row in place::

    gated_delta_rule   program (sequence b, value head h, block of v_dim)
        S [k_dim, BLOCK_V] = exp(g) * states[slot_b, h]       (zeros when the sequence starts here)
        u = beta * (v - S^T k);  S += k u^T;  o = S^T q        q, k L2-normalised in float32
    causal_conv1d      program (sequence b, block of channels)
        out = silu(sum_j state[:, j] * w[:, j] + x * w[:, K-1]);  state <- [state[:, 1:], x]

Longer sequences of the step (prefill chunks) still run the torch reference, one by one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from framework import ops_linear_attention as reference
from framework.ops_linear_attention import StateIndices


@triton.jit
def _recurrent_step_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    states_ptr,
    out_ptr,
    rows_ptr,
    slots_ptr,
    resume_ptr,
    stride_q,
    stride_k,
    stride_v,
    stride_gb,
    stride_o,
    scale,
    HEADS_PER_KEY: tl.constexpr,
    NUM_V_HEADS: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(rows_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    resume = tl.load(resume_ptr + b)
    key_head = head // HEADS_PER_KEY
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = dk < K_DIM, dv < V_DIM
    q = tl.load(q_ptr + row * stride_q + key_head * K_DIM + dk, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_k + key_head * K_DIM + dk, mask=k_mask, other=0.0).to(tl.float32)
    if USE_QK_L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q * scale
    v = tl.load(v_ptr + row * stride_v + head * V_DIM + dv, mask=v_mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_gb + head).to(tl.float32)
    beta = tl.load(beta_ptr + row * stride_gb + head).to(tl.float32)
    # states [num_slots, Hv, Dk, Dv] float32, contiguous
    state_ptrs = states_ptr + ((slot * NUM_V_HEADS + head) * K_DIM + dk[:, None]) * V_DIM + dv[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    # a sequence starting here ignores its row (whatever the slot's last holder left there)
    state = tl.where(resume != 0, tl.load(state_ptrs, mask=mask, other=0.0), 0.0)
    state = state * tl.exp(g)
    update = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state = state + k[:, None] * update[None, :]
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(state_ptrs, state, mask=mask)
    tl.store(out_ptr + row * stride_o + head * V_DIM + dv, out.to(out_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def _conv_step_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    states_ptr,
    out_ptr,
    rows_ptr,
    slots_ptr,
    resume_ptr,
    stride_x,
    stride_o,
    CHANNELS: tl.constexpr,
    KERNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    resume = tl.load(resume_ptr + b)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < CHANNELS
    x = tl.load(x_ptr + row * stride_x + d, mask=mask, other=0.0)
    # states [num_slots, D, K - 1], weight [D, K], both contiguous
    state_ptrs = states_ptr + (slot * CHANNELS + d) * (KERNEL - 1)
    acc = x.to(tl.float32) * tl.load(weight_ptr + d * KERNEL + KERNEL - 1, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(KERNEL - 1):
        tap = tl.where(resume != 0, tl.load(state_ptrs + j, mask=mask, other=0.0), 0.0)
        acc += tap.to(tl.float32) * tl.load(weight_ptr + d * KERNEL + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(state_ptrs + j - 1, tap.to(states_ptr.dtype.element_ty), mask=mask)  # shift left
    tl.store(state_ptrs + KERNEL - 2, x.to(states_ptr.dtype.element_ty), mask=mask)
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + row * stride_o + d, out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    indices: StateIndices,
    use_qk_l2norm: bool = True,
) -> Tensor:
    """:func:`framework.ops_linear_attention.gated_delta_rule`, its one-token sequences in one launch."""
    out = torch.empty_like(v)
    num_decodes = indices.decode_rows.numel()
    if num_decodes:
        num_v, k_dim, v_dim = v.shape[1], q.shape[2], v.shape[2]
        block_v = min(32, triton.next_power_of_2(v_dim))
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        g, beta = g.contiguous(), beta.contiguous()
        _recurrent_step_kernel[(num_decodes, num_v, triton.cdiv(v_dim, block_v))](
            q, k, v, g, beta, states, out,
            indices.decode_rows, indices.decode_slots, indices.decode_has_initial_state,
            q.stride(0), k.stride(0), v.stride(0), g.stride(0), out.stride(0), k_dim**-0.5,
            HEADS_PER_KEY=num_v // q.shape[1], NUM_V_HEADS=num_v, K_DIM=k_dim, V_DIM=v_dim,
            BLOCK_K=triton.next_power_of_2(k_dim), BLOCK_V=block_v, USE_QK_L2NORM=use_qk_l2norm,
            num_warps=4,
        )  # fmt: skip
    for r in indices.longer:
        rows, slot, resume = indices.sequence(r)
        out[rows], states[slot] = reference.chunk_gated_delta_rule(
            q[rows], k[rows], v[rows], g[rows], beta[rows], states[slot] if resume else None, use_qk_l2norm
        )
    return out


def causal_conv1d(
    x: Tensor, weight: Tensor, conv_states: Tensor, indices: StateIndices, bias: Tensor | None = None
) -> Tensor:
    """:func:`framework.ops_linear_attention.causal_conv1d`, its one-token sequences in one launch."""
    if indices.longer:  # the prefill chunks' rows through the reference, the decode rows below
        out = reference.causal_conv1d(x, weight, conv_states, indices.without_decodes(), bias)
    else:
        out = torch.empty_like(x)
    num_decodes = indices.decode_rows.numel()
    if num_decodes:
        channels, kernel = weight.shape
        weight = weight.contiguous()
        x = x if x.stride(-1) == 1 else x.contiguous()
        block_d = min(256, triton.next_power_of_2(channels))
        _conv_step_kernel[(num_decodes, triton.cdiv(channels, block_d))](
            x, weight, weight if bias is None else bias, conv_states, out,
            indices.decode_rows, indices.decode_slots, indices.decode_has_initial_state,
            x.stride(0), out.stride(0),
            CHANNELS=channels, KERNEL=kernel, HAS_BIAS=bias is not None, BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out
