"""Triton kernels of gated-delta-net layers: the recurrent state update and the short conv.

Same signatures and results as :func:`framework.ops_linear_attention.gated_delta_rule` and
:func:`~framework.ops_linear_attention.causal_conv1d`; every sequence of a step runs here, each
program reading and writing its sequence's state row in place::

    gated_delta_rule   decodes: program (sequence b, value head h, block of v_dim):
        S [k_dim, BLOCK_V] = states[slot_b, h]                (zeros when the sequence starts here)
        S *= exp(g);  u = beta * (v - S^T k);  S += k u^T;  o = S^T q
        (q, k L2-normalised in float32; S stays in registers, written back once);
                       prefill chunks: the chunked (WY) kernels of :mod:`fw_triton_ops.gated_delta_chunk`
    causal_conv1d      decodes: program (sequence, channel block): one output, the state shifted;
                       prefill chunks: program (sequence, channel block, token block) for the
                       outputs (inputs before the chunk come from the state), then a second launch
                       stores each sequence's last ``kernel - 1`` inputs as its new state

Decode steps touch only device tensors, so they run inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from framework.ops_linear_attention import StateIndices
from fw_triton_ops.gated_delta_chunk import chunked_gated_delta_rule


@triton.jit
def _recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    states_ptr,
    out_ptr,
    starts_ptr,
    ends_ptr,
    slots_ptr,
    resume_ptr,
    index_stride,
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
    b = tl.program_id(0).to(tl.int64) * index_stride
    head = tl.program_id(1)
    start, end = tl.load(starts_ptr + b), tl.load(ends_ptr + b)
    slot, resume = tl.load(slots_ptr + b), tl.load(resume_ptr + b)
    key_head = head // HEADS_PER_KEY
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = dk < K_DIM, dv < V_DIM
    mask = k_mask[:, None] & v_mask[None, :]
    # states [num_slots, Hv, Dk, Dv] float32, contiguous
    state_ptrs = states_ptr + ((slot * NUM_V_HEADS + head) * K_DIM + dk[:, None]) * V_DIM + dv[None, :]
    # a sequence starting here ignores its row (whatever the slot's last holder left there)
    state = tl.where(resume != 0, tl.load(state_ptrs, mask=mask, other=0.0), 0.0)
    for row in range(start, end):
        q = tl.load(q_ptr + row * stride_q + key_head * K_DIM + dk, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * stride_k + key_head * K_DIM + dk, mask=k_mask, other=0.0).to(tl.float32)
        if USE_QK_L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(v_ptr + row * stride_v + head * V_DIM + dv, mask=v_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_gb + head).to(tl.float32)
        beta = tl.load(beta_ptr + row * stride_gb + head).to(tl.float32)
        state = state * tl.exp(g)
        update = (v - tl.sum(state * k[:, None], axis=0)) * beta
        state = state + k[:, None] * update[None, :]
        out = tl.sum(state * (q * scale)[:, None], axis=0)
        tl.store(out_ptr + row * stride_o + head * V_DIM + dv, out.to(out_ptr.dtype.element_ty), mask=v_mask)
    tl.store(state_ptrs, state, mask=mask)


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


@triton.jit
def _input_at(x_ptr, state_ptrs, stride_x, start, position, d_mask, t_mask, resume, KERNEL: tl.constexpr):
    """The conv's input at ``position`` (relative to the chunk's first token; negative: the state's
    column ``K - 1 + position``), ``[BLOCK_T, BLOCK_D]``."""
    in_chunk = position >= 0
    from_x = tl.load(
        x_ptr + (start + position)[:, None] * stride_x,
        mask=(t_mask & in_chunk)[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    column = tl.where(in_chunk, 0, KERNEL - 1 + position)
    from_state = tl.load(
        state_ptrs[None, :] + column[:, None], mask=(t_mask & ~in_chunk)[:, None] & d_mask[None, :], other=0.0
    ).to(tl.float32)
    from_state = tl.where(resume != 0, from_state, 0.0)  # a sequence starting here: zeros before it
    return tl.where(in_chunk[:, None], from_x, from_state)


@triton.jit
def _conv_chunk_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    states_ptr,
    out_ptr,
    table_ptr,
    stride_x,
    stride_o,
    CHANNELS: tl.constexpr,
    KERNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    entry = table_ptr + tl.program_id(0).to(tl.int64) * 4  # (start, end, slot, has_initial_state)
    start, end, slot, resume = tl.load(entry), tl.load(entry + 1), tl.load(entry + 2), tl.load(entry + 3)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < end - start
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < CHANNELS
    state_ptrs = states_ptr + (slot * CHANNELS + d) * (KERNEL - 1)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(KERNEL):
        tap = _input_at(
            x_ptr + d[None, :], state_ptrs, stride_x, start, t - (KERNEL - 1) + j, d_mask, t_mask, resume, KERNEL
        )
        acc += tap * tl.load(weight_ptr + d * KERNEL + j, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    out = acc / (1.0 + tl.exp(-acc))
    out_ptrs = out_ptr + (start + t)[:, None] * stride_o + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & d_mask[None, :])


@triton.jit
def _conv_state_kernel(
    x_ptr,
    states_ptr,
    table_ptr,
    stride_x,
    CHANNELS: tl.constexpr,
    KERNEL: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """A chunk's new conv state: its last ``K - 1`` inputs (reaching into the old state when the chunk
    is shorter); run after :func:`_conv_chunk_kernel` has read the old state."""
    entry = table_ptr + tl.program_id(0).to(tl.int64) * 4
    start, end, slot, resume = tl.load(entry), tl.load(entry + 1), tl.load(entry + 2), tl.load(entry + 3)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < CHANNELS
    state_ptrs = states_ptr + (slot * CHANNELS + d) * (KERNEL - 1)
    c = tl.arange(0, BLOCK_C)  # state columns (BLOCK_C >= K - 1, a power of two)
    c_mask = c < KERNEL - 1
    position = (end - start) - (KERNEL - 1) + c
    window = _input_at(x_ptr + d[None, :], state_ptrs, stride_x, start, position, d_mask, c_mask, resume, KERNEL)
    mask = c_mask[:, None] & d_mask[None, :]
    tl.store(state_ptrs[None, :] + c[:, None], window.to(states_ptr.dtype.element_ty), mask=mask)


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
    """:func:`framework.ops_linear_attention.gated_delta_rule`: the decodes in one recurrent launch,
    the prefill chunks in the chunked (WY) kernels of :mod:`fw_triton_ops.gated_delta_chunk`."""
    out = torch.empty_like(v)
    num_v, k_dim, v_dim = v.shape[1], q.shape[2], v.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    rows = indices.decode_rows
    if rows.numel():
        block_v = min(32, triton.next_power_of_2(v_dim))
        _recurrent_kernel[(rows.numel(), num_v, triton.cdiv(v_dim, block_v))](
            q, k, v, g, beta, states, out, rows, rows + 1, indices.decode_slots, indices.decode_has_initial_state, 1,
            q.stride(0), k.stride(0), v.stride(0), g.stride(0), out.stride(0), k_dim**-0.5,
            HEADS_PER_KEY=num_v // q.shape[1], NUM_V_HEADS=num_v, K_DIM=k_dim, V_DIM=v_dim,
            BLOCK_K=triton.next_power_of_2(k_dim), BLOCK_V=block_v, USE_QK_L2NORM=use_qk_l2norm,
            num_warps=4,
        )  # fmt: skip
    if indices.longer_table.shape[0]:
        chunked_gated_delta_rule(
            q, k, v, g, beta, states, indices.longer_table, indices.max_longer_len(), out, use_qk_l2norm
        )
    return out


def causal_conv1d(
    x: Tensor, weight: Tensor, conv_states: Tensor, indices: StateIndices, bias: Tensor | None = None
) -> Tensor:
    """:func:`framework.ops_linear_attention.causal_conv1d`: decodes in one launch, prefill chunks in two."""
    out = torch.empty_like(x)
    channels, kernel = weight.shape
    weight = weight.contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    bias_arg = weight if bias is None else bias
    block_d = min(256, triton.next_power_of_2(channels))
    num_decodes, table = indices.decode_rows.numel(), indices.longer_table
    if num_decodes:
        _conv_step_kernel[(num_decodes, triton.cdiv(channels, block_d))](
            x, weight, bias_arg, conv_states, out,
            indices.decode_rows, indices.decode_slots, indices.decode_has_initial_state,
            x.stride(0), out.stride(0),
            CHANNELS=channels, KERNEL=kernel, HAS_BIAS=bias is not None, BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    if table.shape[0]:
        block_t, block_c = 16, min(64, block_d)
        grid = (table.shape[0], triton.cdiv(channels, block_c), triton.cdiv(indices.max_longer_len(), block_t))
        _conv_chunk_kernel[grid](
            x, weight, bias_arg, conv_states, out, table, x.stride(0), out.stride(0),
            CHANNELS=channels, KERNEL=kernel, HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_D=block_c,
            num_warps=4,
        )  # fmt: skip
        _conv_state_kernel[(table.shape[0], triton.cdiv(channels, block_d))](
            x, conv_states, table, x.stride(0),
            CHANNELS=channels, KERNEL=kernel, BLOCK_C=triton.next_power_of_2(kernel - 1), BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out
