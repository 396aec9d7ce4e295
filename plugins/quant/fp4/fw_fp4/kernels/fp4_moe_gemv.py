"""FP4 experts for one token on integer dot products: :func:`one_token_moe`, the decode form of
:func:`fw_fp4.kernels.fp4_moe.quantized_fused_moe`.

A decode token reads its ``top_k`` experts' weights once, so the step is bound by those bytes.
Each expert row is ``K/2`` contiguous bytes (``[E, rows, K/2]``, low nibble first), read as
int32 words of 8 codes, with one scale byte per group ``[E, rows, K/G]``; the activations are
rounded to int8 per 32 inputs and multiplied with ``dp4a`` (:mod:`fw_fp4.kernels.int8_dot`)::

    kernel 1, program (pair j, BLOCK_N rows):  gate, up = W1[e_j] x_q, W3[e_j] x_q    (+ biases, global scales)
                                               act[j] = SiLU-and-mul or gpt-oss's clamped SwiGLU  (x's dtype)
    kernel 2, program (pair j, BLOCK_N rows):  out[j] = (W2[e_j] act_q[j] + bias) * routing weight   (fp32)
    result = sum_j out[j], in x's dtype

Per step a program loads ``[BLOCK_N, STEP / 32, 32 / G, G / 8]`` words: 16 contiguous bytes of
each row per x group, the groups of a row side by side. So the result is the exact experts' times
x (and the activations) rounded to 8 bits per 32 inputs: :func:`one_token_reference` is that in
torch. No host sync: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fw_triton_ops.fused_moe import gate_up_activation
from torch import Tensor

from framework.ops import PLAIN_SWIGLU, MoEActivation, PackedExperts

from .fp4_decode import scale_factor
from .int8_dot import emulate, quantize_x, quantize_x_reference, split_x_words, word_dot

#: ``quant_type`` -> (inputs per scale byte, scales are rebased e8m0), as ``fp4_moe.QUANT_TYPES``.
GROUPS = {"mxfp4": (32, True), "nvfp4": (16, False)}


@triton.jit
def _row_dot(
    acc,
    x_lo,
    x_hi,
    d_x,
    w_ptr,
    s_ptr,
    rows,
    live,
    stride_wn,
    stride_sn,
    k0,
    K,
    XG: tl.constexpr,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """``acc [BN] += W[rows, k0 : k0 + 32 XG] . x_q`` (without the global scale); ``w_ptr`` bytes
    of one expert, rows ``stride_wn`` bytes apart; ``x_lo / x_hi [XG, GPX, WPG]``, ``d_x [XG]``."""
    GPX: tl.constexpr = 32 // GROUP
    WPG: tl.constexpr = GROUP // 8
    a = tl.arange(0, XG)[None, :, None, None]
    g = tl.arange(0, GPX)[None, None, :, None]
    w = tl.arange(0, WPG)[None, None, None, :]
    word = k0 // 8 + a * 4 + g * WPG + w  # [1, XG, GPX, WPG]
    r = rows[:, None, None, None]
    mask = (word < K // 8) & live[:, None, None, None]
    codes = tl.load((w_ptr + r * stride_wn).to(tl.pointer_type(tl.int32)) + word, mask=mask, other=0)
    sums = tl.sum(word_dot(codes, x_lo[None], x_hi[None], EMULATE), axis=3)  # [BN, XG, GPX]
    group = k0 // GROUP + tl.arange(0, XG)[None, :, None] * GPX + tl.arange(0, GPX)[None, None, :]
    smask = (group < K // GROUP) & live[:, None, None]
    sbytes = tl.load(s_ptr + rows[:, None, None] * stride_sn + group, mask=smask, other=0)
    scaled = tl.sum(sums.to(tl.float32) * scale_factor(sbytes.to(tl.int32), E8M0), axis=2)  # [BN, XG]
    return acc + tl.sum(scaled * d_x[None, :], axis=1)


@triton.jit
def _one_token_gate_up_kernel(
    x_ptr,
    gate_ptr,
    up_ptr,
    gate_s_ptr,
    up_s_ptr,
    gate_g_ptr,
    up_g_ptr,
    bias_ptr,
    act_ptr,
    ids_ptr,
    HIDDEN,
    INTER,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    swiglu_alpha,
    swiglu_limit,
    STEP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU_OAI: tl.constexpr,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    EMULATE: tl.constexpr,
):
    XG: tl.constexpr = STEP // 32
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < INTER
    acc_gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    gate, up = gate_ptr + expert * stride_we, up_ptr + expert * stride_we
    gate_s, up_s = gate_s_ptr + expert * stride_se, up_s_ptr + expert * stride_se
    for k0 in range(0, HIDDEN, STEP):
        x_words, d_x = quantize_x(x_ptr, k0, HIDDEN, XG)
        x_lo, x_hi = split_x_words(x_words, XG, 32 // GROUP, GROUP // 8)
        acc_gate = _row_dot(
            acc_gate,
            x_lo,
            x_hi,
            d_x,
            gate,
            gate_s,
            rows,
            live,
            stride_wn,
            stride_sn,
            k0,
            HIDDEN,
            XG,
            GROUP,
            E8M0,
            EMULATE,
        )
        acc_up = _row_dot(
            acc_up, x_lo, x_hi, d_x, up, up_s, rows, live, stride_wn, stride_sn, k0, HIDDEN, XG, GROUP, E8M0, EMULATE
        )
    if HAS_GLOBAL:
        acc_gate *= tl.load(gate_g_ptr + expert)
        acc_up *= tl.load(up_g_ptr + expert)
    out_dtype = act_ptr.dtype.element_ty
    act = gate_up_activation(
        acc_gate[None, :],
        acc_up[None, :],
        bias_ptr,
        expert,
        rows,
        live,
        INTER,
        out_dtype,
        swiglu_alpha,
        swiglu_limit,
        HAS_BIAS,
        SWIGLU_OAI,
    )
    tl.store(act_ptr + pair * INTER + rows[None, :], act.to(out_dtype), mask=live[None, :])


@triton.jit
def _one_token_down_kernel(
    act_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    bias_ptr,
    out_ptr,
    weights_ptr,
    ids_ptr,
    HIDDEN,
    INTER,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    STEP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    EMULATE: tl.constexpr,
):
    XG: tl.constexpr = STEP // 32
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < HIDDEN
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    w, s = w_ptr + expert * stride_we, s_ptr + expert * stride_se
    x_ptr = act_ptr + pair * INTER
    for k0 in range(0, INTER, STEP):
        x_words, d_x = quantize_x(x_ptr, k0, INTER, XG)
        x_lo, x_hi = split_x_words(x_words, XG, 32 // GROUP, GROUP // 8)
        acc = _row_dot(
            acc, x_lo, x_hi, d_x, w, s, rows, live, stride_wn, stride_sn, k0, INTER, XG, GROUP, E8M0, EMULATE
        )
    if HAS_GLOBAL:
        acc *= tl.load(g_ptr + expert)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * HIDDEN + rows, mask=live, other=0.0).to(tl.float32)
    routing = tl.load(weights_ptr + pair).to(tl.float32)
    out = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * routing
    tl.store(out_ptr + pair * HIDDEN + rows, out, mask=live)


#: The launch setting: rows a program, inputs a step, warps (``benchmarks/w4a16_kernels.py --moe --sweep``).
ONE_TOKEN_TILES = {"BLOCK_N": 32, "STEP": 256, "num_warps": 4, "num_stages": 2}


def one_token_supported(hidden_size: int, intermediate_size: int) -> bool:
    """Whether :func:`one_token_moe` takes these experts: both inner sizes whole x groups of 32."""
    return hidden_size % 32 == 0 and intermediate_size % 32 == 0


def one_token_moe(
    hidden: Tensor,
    w1: PackedExperts,
    w3: PackedExperts,
    w2: PackedExperts,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: MoEActivation = PLAIN_SWIGLU,
    tiles: dict | None = None,
) -> Tensor:
    """``quantized_fused_moe`` for one token ``hidden [1, H]`` (contiguous) of FP4 experts (types
    of :data:`GROUPS`, all three alike, global scales on all or none), x and the activations
    rounded to int8 per 32 inputs. ``tiles`` overrides :data:`ONE_TOKEN_TILES`' keys."""
    assert hidden.shape[0] == 1 and topk_ids.shape[0] == 1, (hidden.shape, topk_ids.shape)
    group, e8m0 = GROUPS[w1.quant_type]
    meta = dict(ONE_TOKEN_TILES)
    if tiles:
        unknown = set(tiles) - set(ONE_TOKEN_TILES)
        if unknown:
            raise ValueError(f"tiles {sorted(unknown)}; valid: {sorted(ONE_TOKEN_TILES)}")
        meta.update(tiles)
    block_n = meta["BLOCK_N"]
    has_global = w1.global_scales is not None
    hidden_size, inter = hidden.shape[1], w1.data.shape[1]
    assert one_token_supported(hidden_size, inter), (hidden_size, inter)
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).to(torch.int32)
    formats = dict(GROUP=group, E8M0=e8m0, HAS_GLOBAL=has_global, EMULATE=emulate())
    w13_bias, w2_bias = activation.w13_bias, activation.w2_bias
    act = torch.empty(top_k, inter, dtype=hidden.dtype, device=hidden.device)
    _one_token_gate_up_kernel[(top_k, triton.cdiv(inter, block_n))](
        hidden,
        w1.data,
        w3.data,
        w1.scales,
        w3.scales,
        w1.global_scales if has_global else w1.scales,
        w3.global_scales if has_global else w3.scales,
        w1.data if w13_bias is None else w13_bias.contiguous(),
        act,
        ids,
        hidden_size,
        inter,
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
    per_pair = torch.empty(top_k, hidden_size, dtype=torch.float32, device=hidden.device)
    _one_token_down_kernel[(top_k, triton.cdiv(hidden_size, block_n))](
        act,
        w2.data,
        w2.scales,
        w2.global_scales if has_global else w2.scales,
        w2.data if w2_bias is None else w2_bias.contiguous(),
        per_pair,
        topk_weights.reshape(-1).float(),
        ids,
        hidden_size,
        inter,
        w2.data.stride(0),
        w2.data.stride(1),
        w2.scales.stride(0),
        w2.scales.stride(1),
        HAS_BIAS=w2_bias is not None,
        **formats,
        **meta,
    )
    return per_pair.sum(0, keepdim=True).to(hidden.dtype)


def one_token_reference(
    hidden: Tensor,
    w1: PackedExperts,
    w3: PackedExperts,
    w2: PackedExperts,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: MoEActivation = PLAIN_SWIGLU,
) -> Tensor:
    """What :func:`one_token_moe` computes, in torch (float32 matmuls): the dequantized experts
    times ``x`` rounded as the kernel rounds it, the activations rounded to ``hidden``'s dtype and
    then to int8 per 32 inputs, each expert's output rounded to ``hidden``'s dtype, weighted in fp32."""
    ids = topk_ids.reshape(-1).long()
    x = quantize_x_reference(hidden).expand(ids.numel(), -1).unsqueeze(-1)  # [P, H, 1]
    gate = torch.bmm(w1.experts(ids, torch.float32), x).squeeze(-1)
    up = torch.bmm(w3.experts(ids, torch.float32), x).squeeze(-1)
    gate_up = torch.cat([gate, up], 1)
    if (bias := activation.bias("w13", ids)) is not None:
        gate_up = gate_up + bias.float()
    act = activation.act(gate_up.to(hidden.dtype)).to(hidden.dtype)
    out = torch.bmm(w2.experts(ids, torch.float32), quantize_x_reference(act).unsqueeze(-1)).squeeze(-1)
    if (bias := activation.bias("w2", ids)) is not None:
        out = out + bias.float()
    weighted = out.to(hidden.dtype).float() * topk_weights.reshape(-1, 1).float()
    return weighted.sum(0, keepdim=True).to(hidden.dtype)
