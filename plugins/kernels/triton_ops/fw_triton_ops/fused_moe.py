"""The routed experts of a MoE layer as two grouped GEMMs (:func:`framework.ops.fused_moe`).

Every (token, chosen expert) pair ``p = token * top_k + j`` is one row of work. The pairs are
sorted by expert and each expert's group padded to a multiple of ``BLOCK_M``, so a block of
``BLOCK_M`` rows always belongs to one expert::

    sorted_pair_ids:  [ e0 e0 e0 pad | e3 e3 pad pad | e5 ... ]     (pad = num_pairs: masked out)
    block_expert_ids: [     0        |      3        |  5  ... -1 -1 ]  (-1: an unused block exits)

Kernel 1 (one launch): rows of ``hidden`` gathered by token, times expert e's gate and up rows
of ``w13`` (two accumulators), SiLU-and-mul fused, written per pair: ``act [P, I]``.
Kernel 2 (one launch): ``act`` times ``w2[e]``, scaled by the pair's routing weight: ``[P, H]``.
Kernel 3 (one launch): the ``top_k`` rows of each token summed in float32, in order, rounded once.

Grids are sized from shapes only (``cdiv(P, BLOCK_M) + min(P, E)`` blocks bound the padded
groups), the sort runs on the device (one Triton program for a decode batch, torch's sort for
larger ones), and nothing syncs with the host: decode steps can be
CUDA-graphed. Rounding follows the reference: the projections are rounded to the activation
dtype before SiLU-and-mul and before the routing weight, as transformers' experts compute them.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from framework.ops import PLAIN_SWIGLU, MoEActivation, moe_align_block_size
from fw_triton_ops.activation import _sigmoid


@triton.jit
def _block_rows(sorted_ids_ptr, block_expert_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's expert (-1: nothing to do), its pair ids and which of them are real."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return expert, pairs, pairs < num_pairs


@triton.jit
def gate_up_activation(
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
    HAS_BIAS: tl.constexpr,
    SWIGLU_OAI: tl.constexpr,
):
    """The epilogue of a gate/up kernel: biases ``[E, 2 * INTER]`` (gate then up) added in float32,
    the projections rounded to ``out_dtype`` as the reference rounds them, then SiLU-and-mul or
    gpt-oss's clamped SwiGLU; returns the activations in float32 (shared with fw-fp4's MXFP4 kernel)."""
    if HAS_BIAS:
        bias_row = bias_ptr + expert * 2 * INTER
        acc_gate += tl.load(bias_row + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias_row + INTER + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    g = acc_gate.to(out_dtype).to(tl.float32)
    u = acc_up.to(out_dtype).to(tl.float32)
    if SWIGLU_OAI:  # gpt-oss: clamp, then (up + 1) * gate * sigmoid(alpha * gate)
        g = tl.minimum(g, swiglu_limit)
        u = tl.minimum(tl.maximum(u, -swiglu_limit), swiglu_limit)
        act = (g * _sigmoid(g * swiglu_alpha)) * (u + 1.0)
    else:
        act = (g * _sigmoid(g)).to(out_dtype).to(tl.float32) * u
    return act


@triton.jit
def gelu_tanh_activation(acc_gate, acc_up, out_dtype):
    """GeGLU's epilogue (Gemma 4's experts): the projections rounded to ``out_dtype``, then
    ``gelu_tanh(gate)`` rounded again and times ``up``, as ``gelu_tanh_and_mul`` computes it; float32."""
    g = acc_gate.to(out_dtype).to(tl.float32)
    u = acc_up.to(out_dtype).to(tl.float32)
    # 0.5 g (1 + tanh(z)) == g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3): no cancellation for g < 0
    gelu = g * _sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    return gelu.to(out_dtype).to(tl.float32) * u


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,
    w_ptr,
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
    swiglu_alpha,
    swiglu_limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU_OAI: tl.constexpr,
    GELU_TANH: tl.constexpr,
):
    expert, pairs, valid = _block_rows(sorted_ids_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    tokens = pairs // top_k
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < INTER
    w_base = w_ptr + expert * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < HIDDEN
        a = tl.load(x_ptr + tokens[:, None] * stride_xm + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        gate = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)  # [K, N]
        up = tl.load(w_base + (cols[None, :] + INTER) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        if CAST_FP32:  # the interpreter computes bf16 wrongly
            a, gate, up = a.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
        acc_gate = tl.dot(a, gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
    if GELU_TANH:  # no biases with GeGLU experts (FusedMoE refuses the combination)
        act = gelu_tanh_activation(acc_gate, acc_up, act_ptr.dtype.element_ty)
    else:
        act = gate_up_activation(
            acc_gate,
            acc_up,
            bias_ptr,
            expert,
            cols,
            col_mask,
            INTER,
            act_ptr.dtype.element_ty,
            swiglu_alpha,
            swiglu_limit,
            HAS_BIAS,
            SWIGLU_OAI,
        )
    out_dtype = act_ptr.dtype.element_ty
    tl.store(
        act_ptr + pairs[:, None] * INTER + cols[None, :], act.to(out_dtype), mask=valid[:, None] & col_mask[None, :]
    )


@triton.jit
def _down_weighted_kernel(
    act_ptr,
    w_ptr,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    expert, pairs, valid = _block_rows(sorted_ids_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < HIDDEN
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < INTER
        a = tl.load(act_ptr + pairs[:, None] * INTER + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(
            w_base + cols[None, :] * stride_wn + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0
        )
        if CAST_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    out_dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:  # [E, HIDDEN]
        acc += tl.load(bias_ptr + expert * HIDDEN + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    routing = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    out = acc.to(out_dtype).to(tl.float32) * routing[:, None]
    tl.store(
        out_ptr + pairs[:, None] * HIDDEN + cols[None, :], out.to(out_dtype), mask=valid[:, None] & col_mask[None, :]
    )


#: Up to this many pairs (batch 4 at top-8) one program sorts them (one launch instead of ~15 torch ops).
MAX_PAIRS_ONE_PROGRAM = 32


@triton.jit
def _align_one_program_kernel(
    ids_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """:func:`align_pairs_to_blocks` for few pairs in one program (a counting sort)::

    rank[p] = how many earlier pairs chose the same expert as p
    slot[p] = padded_start[expert of p] + rank[p];   every other slot holds num_pairs (padding)
    """
    p = tl.arange(0, BLOCK_P)
    p_mask = p < num_pairs
    ids = tl.load(ids_ptr + p, mask=p_mask, other=-1).to(tl.int32)
    e = tl.arange(0, BLOCK_E)
    onehot = (ids[:, None] == e[None, :]).to(tl.int32)  # [P, E]
    counts = tl.sum(onehot, axis=0)
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    slot = tl.sum(onehot * (padded_end - padded)[None, :], axis=1) + rank
    s = tl.arange(0, BLOCK_S)
    tl.store(sorted_ids_ptr + s, tl.full((BLOCK_S,), 0, tl.int32) + num_pairs, mask=s < num_blocks * BLOCK_M)
    tl.debug_barrier()  # the padding is written before the pairs overwrite their slots
    tl.store(sorted_ids_ptr + slot, p, mask=p_mask)
    b = tl.arange(0, BLOCK_B)
    block_expert = tl.sum((padded_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + b, tl.where(block_expert < num_experts, block_expert, -1), mask=b < num_blocks)


@triton.jit
def _sum_top_k_kernel(per_pair_ptr, out_ptr, HIDDEN, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < HIDDEN
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(per_pair_ptr + (token * TOP_K + j) * HIDDEN + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * HIDDEN + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_top_k(per_pair: Tensor, num_tokens: int, top_k: int) -> Tensor:
    """``per_pair [T * top_k, H]`` (pair ``p = token * top_k + j``) summed over ``j`` in float32,
    rounded once to its dtype: ``[T, H]``, one launch (torch's sum and cast took two)."""
    hidden_size = per_pair.shape[-1]
    out = torch.empty(num_tokens, hidden_size, dtype=per_pair.dtype, device=per_pair.device)
    block_n = min(512, triton.next_power_of_2(hidden_size))
    _sum_top_k_kernel[(num_tokens, triton.cdiv(hidden_size, block_n))](
        per_pair, out, hidden_size, TOP_K=top_k, BLOCK_N=block_n, num_warps=4
    )
    return out


def launch_config(num_pairs: int) -> dict[str, int]:
    """Tile sizes: small ``BLOCK_M`` for decode (few rows per expert), larger tiles for prefill."""
    if num_pairs <= 256:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def align_pairs_to_blocks(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """:func:`framework.ops.moe_align_block_size` (the ``moe_align_block_size`` op): one Triton
    program for a decode batch (up to :data:`MAX_PAIRS_ONE_PROGRAM` pairs), the reference's device
    sort for more. ``(sorted_pair_ids [num_blocks * block_m], block_expert_ids [num_blocks])``."""
    flat = topk_ids.reshape(-1)  # int32 or int64: the kernel reads either (no conversion launch)
    num_pairs, device = flat.numel(), flat.device
    if num_pairs > MAX_PAIRS_ONE_PROGRAM:
        return moe_align_block_size(topk_ids, num_experts, block_m)
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_pairs, num_experts)
    sorted_pair_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    _align_one_program_kernel[(1,)](
        flat,
        sorted_pair_ids,
        block_expert_ids,
        num_pairs,
        num_experts,
        num_blocks,
        BLOCK_M=block_m,
        BLOCK_P=triton.next_power_of_2(num_pairs),
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_S=triton.next_power_of_2(num_blocks * block_m),
        BLOCK_B=triton.next_power_of_2(num_blocks),
        num_warps=8,
    )
    return sorted_pair_ids, block_expert_ids


class GroupedLaunch(NamedTuple):
    """How one MoE call's pairs are laid out for the grouped-GEMM kernels (shared with other
    plugins' expert kernels, such as fw-fp4's MXFP4 ones)."""

    sorted_pair_ids: Tensor
    block_expert_ids: Tensor
    num_blocks: int
    block_n: int
    meta: dict  # the kernels' tile and precision constexprs and launch options


def plan_grouped_launch(hidden: Tensor, topk_ids: Tensor, num_experts: int) -> GroupedLaunch:
    """Tiles for ``topk_ids.numel()`` pairs, the pairs sorted into blocks of one expert each."""
    config = launch_config(topk_ids.numel())
    sorted_pair_ids, block_expert_ids = align_pairs_to_blocks(topk_ids, num_experts, config["BLOCK_M"])
    meta = {
        **config,
        "CAST_FP32": os.environ.get("TRITON_INTERPRET") == "1",
        "PRECISION": "ieee" if hidden.dtype == torch.float32 else "tf32",
    }
    return GroupedLaunch(sorted_pair_ids, block_expert_ids, block_expert_ids.numel(), config["BLOCK_N"], meta)


def fused_moe(
    hidden: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: MoEActivation = PLAIN_SWIGLU,
) -> Tensor:
    """:func:`framework.ops.fused_moe` as two grouped-GEMM launches; returns a new ``[T, H]`` tensor.

    ``activation``'s biases are added in float32 to the accumulators, before the rounding to the
    activation dtype that the reference does after its biased matmuls."""
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate_size = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(hidden)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    num_pairs = num_tokens * top_k
    sorted_pair_ids, block_expert_ids, num_blocks, block_n, meta = plan_grouped_launch(hidden, topk_ids, num_experts)
    w13_bias, w2_bias = activation.w13_bias, activation.w2_bias
    act = torch.empty(num_pairs, intermediate_size, dtype=hidden.dtype, device=hidden.device)
    _gate_up_silu_kernel[(num_blocks, triton.cdiv(intermediate_size, block_n))](
        hidden,
        w13,
        w13 if w13_bias is None else w13_bias.contiguous(),
        act,
        sorted_pair_ids,
        block_expert_ids,
        num_pairs,
        top_k,
        hidden_size,
        intermediate_size,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        activation.swiglu_alpha,
        activation.swiglu_limit or 0.0,
        HAS_BIAS=w13_bias is not None,
        SWIGLU_OAI=activation.swiglu_limit is not None,
        GELU_TANH=activation.gelu_tanh,
        **meta,
    )
    per_pair = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).float()
    _down_weighted_kernel[(num_blocks, triton.cdiv(hidden_size, block_n))](
        act,
        w2,
        w2 if w2_bias is None else w2_bias.contiguous(),
        per_pair,
        weights,
        sorted_pair_ids,
        block_expert_ids,
        num_pairs,
        hidden_size,
        intermediate_size,
        w2.stride(0),
        w2.stride(1),
        HAS_BIAS=w2_bias is not None,
        **meta,
    )
    return sum_top_k(per_pair, num_tokens, top_k)
