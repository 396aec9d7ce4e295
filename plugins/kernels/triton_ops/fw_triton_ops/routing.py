"""MoE routing in one launch: :func:`framework.ops_fused.select_experts`.

One program routes ``BLOCK_T`` tokens (one for decode-sized batches), the whole row of ``E``
router logits in registers::

    scores = softmax(logits) | sigmoid(logits)          float32 (loads cast first)
    keys   = scores (+ correction_bias)
    repeat top_k times: best = max(keys); id = the lowest expert with keys == best;
                        weight = scores[id]; keys[id] = -inf
    weights /= sum(weights)                              (renormalize)

so the ids come out largest first with ties to the lower id (the reference's stable sort), and
the weights are the reference's scores. Grids come from shapes only: no host sync, CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from framework.ops_fused import RoutedExperts
from framework.ops_fused import select_experts as reference_select_experts
from fw_triton_ops.activation import _sigmoid

#: The widest router held in registers (a row per program); wider ones take the torch reference.
MAX_EXPERTS = 4096
#: Up to this many tokens each program routes one; more tokens share programs, a few rows each.
ONE_TOKEN_PER_PROGRAM = 256


@triton.jit
def _select_experts_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    stride_t,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    t_mask, e_mask = t < num_tokens, e < NUM_EXPERTS
    rows = t.to(tl.int64)[:, None]
    x = tl.load(logits_ptr + rows * stride_t + e[None, :], mask=t_mask[:, None] & e_mask[None, :], other=0.0)
    x = x.to(tl.float32)
    if SIGMOID:
        scores = _sigmoid(x)
    else:
        x = tl.where(e_mask[None, :], x, float("-inf"))
        shifted = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = shifted / tl.sum(shifted, axis=1)[:, None]
    keys = scores
    if HAS_BIAS:
        keys = keys + tl.load(bias_ptr + e, mask=e_mask, other=0.0).to(tl.float32)[None, :]
    keys = tl.where(e_mask[None, :], keys, float("-inf"))
    j = tl.arange(0, BLOCK_K)
    top_weights = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    top_ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for rank in tl.static_range(TOP_K):
        best = tl.max(keys, axis=1)
        chosen = tl.min(tl.where(keys == best[:, None], e[None, :], BLOCK_E), axis=1)
        picked = e[None, :] == chosen[:, None]
        weight = tl.sum(tl.where(picked, scores, 0.0), axis=1)
        top_weights = tl.where(j[None, :] == rank, weight[:, None], top_weights)
        top_ids = tl.where(j[None, :] == rank, chosen[:, None], top_ids)
        keys = tl.where(picked, float("-inf"), keys)
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=1)[:, None]
    out = rows * TOP_K + j[None, :]
    mask = t_mask[:, None] & (j < TOP_K)[None, :]
    tl.store(weights_ptr + out, top_weights, mask=mask)
    tl.store(ids_ptr + out, top_ids, mask=mask)


def select_experts(
    router_logits: Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    correction_bias: Tensor | None = None,
) -> RoutedExperts:
    """:func:`framework.ops_fused.select_experts` in one launch (routers of up to
    :data:`MAX_EXPERTS` experts; the reference for wider ones). Invalid arguments are refused by
    the reference's checks, with its messages."""
    num_tokens, num_experts = router_logits.shape
    if num_experts > MAX_EXPERTS or scoring not in ("softmax", "sigmoid") or not 0 < top_k <= num_experts:
        return reference_select_experts(router_logits, top_k, renormalize, scoring, correction_bias)
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return RoutedExperts(weights, ids)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    block_e = triton.next_power_of_2(num_experts)
    block_t = 1 if num_tokens <= ONE_TOKEN_PER_PROGRAM else max(1, min(16, 2048 // block_e))
    _select_experts_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits,
        logits if correction_bias is None else correction_bias,
        weights,
        ids,
        num_tokens,
        logits.stride(0),
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        SIGMOID=scoring == "sigmoid",
        HAS_BIAS=correction_bias is not None,
        RENORMALIZE=renormalize,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=max(1, min(8, block_t * block_e // 256)),
    )
    return RoutedExperts(weights, ids)
