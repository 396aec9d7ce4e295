"""Torch references of the kernel-registry ops that stand for short chains of torch ops.

A batch-1 decode step of a MoE model is made of many tiny launches: the router's softmax, top-k
and renormalisation, a sigmoid gate and its product, a gated norm. Each op here is one such
chain, written exactly as the models (and transformers) compute it, so that a fast
implementation can do it in one launch and be tested against it (``framework.ops``' contract:
the signatures below, the returned tensors are the ones to use).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

#: How :func:`select_experts` turns router logits into scores.
SCORING_FUNCTIONS = ("softmax", "sigmoid")


class RoutedExperts(NamedTuple):
    """What a routing function returns: per token, ``top_k`` expert ids and their weights."""

    topk_weights: Tensor  # [T, k] float32
    topk_ids: Tensor  # [T, k] int32


def select_experts(
    router_logits: Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    correction_bias: Tensor | None = None,
) -> RoutedExperts:
    """Route each token of ``router_logits`` ``[T, E]`` to its ``top_k`` experts.

    * ``scoring="softmax"`` (Mixtral, Qwen-MoE, Qwen3.5-MoE): scores are the softmax over the
      experts in float32; the ``top_k`` largest are kept;
    * ``scoring="sigmoid"`` (MiniMax-M2): scores are ``sigmoid(logits)`` in float32; the experts
      are chosen by ``score + correction_bias`` (``[E]``, float32; the bias only chooses) and
      weighted by their scores.

    With ``renormalize`` the ``top_k`` weights are divided by their sum (Mixtral always; Qwen
    when ``norm_topk_prob``). Returns float32 weights and int32 ids ``[T, top_k]``, the largest
    first; among equal scores the lower expert id comes first (a stable sort: ``torch.topk``
    leaves ties in no fixed order, so this is the rule every implementation follows).
    """
    if scoring not in SCORING_FUNCTIONS:
        raise ValueError(f"unknown MoE scoring function {scoring!r}; valid: {', '.join(SCORING_FUNCTIONS)}")
    if not 0 < top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k must be in 1..{router_logits.shape[-1]} (the number of experts), got {top_k}")
    if scoring == "softmax":
        scores = torch.softmax(router_logits.float(), dim=-1)
    else:
        scores = torch.sigmoid(router_logits.float())
    keys = scores if correction_bias is None else scores + correction_bias.float()
    topk_ids = torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :top_k]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return RoutedExperts(topk_weights, topk_ids.to(torch.int32))


def sigmoid_gate_mul(x: Tensor, gate: Tensor, residual: Tensor | None = None) -> Tensor:
    """``x * sigmoid(gate)``, plus ``residual`` when given: a gated attention output (Qwen3.5) or
    a shared expert's contribution added to the routed experts' (Qwen2-MoE, Qwen3.5-MoE).

    ``x`` ``[T, N]``; ``gate`` ``[T, N]``, ``[T, H, N / H]`` (a strided view, as the gate half of
    Qwen3.5's query projection) or ``[T, 1]`` (one gate per token, broadcast); ``residual``
    ``[T, N]`` or None. Rounded to ``x.dtype`` after the sigmoid, the product and the sum, as the
    chain of torch ops rounds. Returns a new ``[T, N]`` tensor.
    """
    gate = gate.reshape(gate.shape[0], -1)
    out = x * torch.sigmoid(gate)
    return out if residual is None else residual + out


def rms_norm_gated(x: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """``rms_norm(x) * weight * silu(gate)`` over the last dimension (Gated DeltaNet's output norm,
    transformers' ``RMSNormGated``): the weighted norm rounded as :func:`framework.ops.rms_norm`
    (``offset=0``), times ``silu(gate)`` in float32, rounded once to ``x.dtype``.

    ``x`` and ``gate`` ``[..., D]`` of the same shape (``gate`` may be a strided view);
    ``weight`` ``[D]``. Returns a new tensor shaped as ``x``.
    """
    from framework.ops import rms_norm

    return (rms_norm(x, weight, eps) * F.silu(gate.float())).to(x.dtype)
