"""The torch reference implementation of every op in the kernel registry.

These run on any device (CPU included), compute in float32 where the models do, and are the
oracle that fast kernels (Triton, FlashInfer) are tested against. Layers never import this
module: they ask ``framework.kernels.get_kernel(op)``, which returns these functions unless a
plugin registered a faster implementation (``framework.builtin.REFERENCE_KERNELS`` registers
them under the name ``torch``).

Contract shared by every implementation of an op: the signatures below, and that the returned
tensors are the ones to use. A fast implementation may update its inputs in place (vLLM's
``fused_add_rms_norm`` and ``rotary_embedding`` do), so callers treat the inputs as consumed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` (``F.linear``): ``x`` ``[..., K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]``
    or None; returns ``[..., N]`` of ``x.dtype``. The unquantized linear layers (and the LM head)
    multiply through this op; a fast implementation may take only the shapes it is good at (a few
    rows for decode) and call ``F.linear`` for the rest."""
    return F.linear(x, weight, bias)


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """RMS-normalise ``x`` over its last dimension and scale by ``offset + weight``.

    Computes ``x * rsqrt(mean(x**2) + eps)`` in float32 and returns ``x.dtype``. The rounding
    order follows the model family, exactly as transformers does:

    * ``offset == 0`` (Llama, Qwen, Mistral, ...): the normalised activations are rounded to
      ``x.dtype`` first, then multiplied by ``weight`` (``LlamaRMSNorm``).
    * ``offset != 0`` (Gemma's ``1 + weight``): the scale ``offset + weight`` is applied in
      float32 and the product rounded once (``Gemma3RMSNorm``).
    """
    dtype = x.dtype
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    if offset == 0.0:
        return (weight * hidden.to(dtype)).to(dtype)
    return (hidden * (offset + weight.float())).to(dtype)


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Add the residual stream, then normalise: returns ``(rms_norm(x + residual), x + residual)``.

    The sum is taken in ``x.dtype``, as the Hugging Face decoder layers do, and the second
    result is the new residual stream for the next layer.
    """
    residual = (x + residual).to(x.dtype)
    return rms_norm(residual, weight, eps, offset), residual


def silu_and_mul(x: Tensor) -> Tensor:
    """SwiGLU: ``x`` is ``[..., 2 * d]`` (gate then up); returns ``silu(gate) * up``, ``[..., d]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_oai_and_mul(x: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's clamped SwiGLU over ``[..., 2 * d]`` (gate then up): the gate clamped to at most
    ``limit``, the up projection to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """GeGLU with the tanh approximation (Gemma): ``gelu_tanh(gate) * up`` over ``[..., 2 * d]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rotary_embedding(
    positions: Tensor,
    query: Tensor,
    key: Tensor,
    head_size: int,
    cos_sin_cache: Tensor,
    is_neox_style: bool,
) -> tuple[Tensor, Tensor]:
    """Rotate ``query`` and ``key`` by their tokens' positions (vLLM's ``rotary_embedding``).

    Shapes: ``positions`` ``[*tokens]`` (int64); ``query`` ``[*tokens, num_heads * head_size]``
    (or ``[*tokens, num_heads, head_size]``); ``key`` likewise with ``num_kv_heads``;
    ``cos_sin_cache`` ``[max_position, rotary_dim]`` holding ``cos`` in its first half and
    ``sin`` in its second (any attention scaling already folded in).

    Only the first ``rotary_dim`` features of each head rotate (partial rotary); the rest pass
    through. The pairs that rotate together::

        neox style (HF rotate_half):   (x[i], x[i + rotary_dim/2])   first half with second half
        GPT-J style (interleaved):     (x[2i], x[2i + 1])            neighbours

    Computed in float32; returns new tensors of the inputs' dtypes and shapes.
    """
    cos, sin = cos_sin_cache.index_select(0, positions.flatten()).float().chunk(2, dim=-1)
    cos = cos.view(*positions.shape, 1, -1)  # broadcast over heads
    sin = sin.view(*positions.shape, 1, -1)
    return (
        _rotate(query, cos, sin, positions.dim(), head_size, is_neox_style),
        _rotate(key, cos, sin, positions.dim(), head_size, is_neox_style),
    )


def qk_norm_rotary_embedding(
    positions: Tensor,
    query: Tensor,
    key: Tensor,
    head_size: int,
    cos_sin_cache: Tensor,
    is_neox_style: bool,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    offset: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """RMS-normalise every head of ``query`` and ``key`` (Qwen3's and Gemma 3's QK norm: one
    ``[head_size]`` weight per projection, shared by its heads), then rotate them.

    Exactly :func:`rms_norm` over each ``head_size`` slice (``q_weight`` for the query heads,
    ``k_weight`` for the key heads, ``eps`` and ``offset`` as there), followed by
    :func:`rotary_embedding` with the same other arguments: one op so that a kernel can do both
    in one launch. Returns new tensors of the inputs' dtypes and shapes.
    """

    def normed(x: Tensor, weight: Tensor) -> Tensor:
        return rms_norm(x.unflatten(-1, (-1, head_size)), weight, eps, offset).flatten(-2).view(x.shape)

    return rotary_embedding(
        positions, normed(query, q_weight), normed(key, k_weight), head_size, cos_sin_cache, is_neox_style
    )


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, num_token_dims: int, head_size: int, is_neox_style: bool) -> Tensor:
    heads = x.reshape(*x.shape[:num_token_dims], -1, head_size)
    rotary_dim = 2 * cos.shape[-1]
    rot, rest = heads[..., :rotary_dim].float(), heads[..., rotary_dim:]
    if is_neox_style:
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated.to(x.dtype), rest), dim=-1).reshape(x.shape)


class MoEActivation(NamedTuple):
    """What an expert applies between its projections, and its biases (keyword arguments of
    :func:`fused_moe` and :func:`quantized_fused_moe`; the defaults are plain SwiGLU without bias).

    ``gelu_tanh``: GeGLU, :func:`gelu_tanh_and_mul` (Gemma 4's experts); ``swiglu_limit`` set:
    gpt-oss's :func:`swiglu_oai_and_mul` with ``swiglu_alpha``; ``w13_bias``
    ``[E, 2 * I]`` (gate then up) is added to the gate/up projection and ``w2_bias`` ``[E, H]`` to
    the down projection, before the routing weight.
    """

    w13_bias: Tensor | None = None
    w2_bias: Tensor | None = None
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    gelu_tanh: bool = False

    def act(self, gate_up: Tensor) -> Tensor:
        if self.gelu_tanh:
            return gelu_tanh_and_mul(gate_up)
        if self.swiglu_limit is None:
            return silu_and_mul(gate_up)
        return swiglu_oai_and_mul(gate_up, self.swiglu_alpha, self.swiglu_limit)

    def bias(self, which: str, experts: Tensor | int) -> Tensor | None:
        """Expert(s) ``experts``' bias of ``"w13"`` or ``"w2"`` (None without one)."""
        bias = self.w13_bias if which == "w13" else self.w2_bias
        return None if bias is None else bias[experts]


PLAIN_SWIGLU = MoEActivation()


def fused_moe(
    hidden: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: MoEActivation = PLAIN_SWIGLU,
) -> Tensor:
    """The routed experts of a mixture-of-experts block, summed with their routing weights.

    Shapes: ``hidden`` ``[T, H]``; ``w13`` ``[E, 2 * I, H]`` (each expert's gate rows, then its
    up rows); ``w2`` ``[E, H, I]``; ``topk_weights`` ``[T, k]`` (float32) and ``topk_ids``
    ``[T, k]`` (integer, in ``[0, E)``) from a routing function such as
    :func:`framework.layers.fused_moe.select_experts`. For every token ``t`` returns::

        sum_j topk_weights[t, j] * w2[e] @ silu_and_mul(w13[e] @ hidden[t])     with e = topk_ids[t, j]

    (``activation``, a :class:`MoEActivation`, may add biases and swap the SwiGLU: gpt-oss).

    Each expert's matmuls and its SwiGLU run in ``hidden.dtype`` (as transformers' experts do);
    the weighted sum is accumulated in float32 and rounded once. Returns ``[T, H]`` of
    ``hidden.dtype``. This reference sorts the (token, expert) pairs by expert and loops over the
    experts that were hit; it syncs with the host once per call (fine on CPU, not CUDA-graphable).
    """
    return _moe_per_expert(
        hidden, lambda expert: (w13[expert], w2[expert]), w13.shape[0], topk_weights, topk_ids, activation
    )


def moe_align_block_size(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """The (token, expert) pairs of a MoE call grouped by expert into blocks of ``block_m`` rows, on
    ``topk_ids``' device: what a grouped-GEMM kernel (one expert per block of rows) iterates over.

    Pair ``p = token * top_k + j`` (``topk_ids`` ``[T, top_k]``, ``P = T * top_k`` pairs). Returns
    ``(sorted_pair_ids [num_blocks * block_m], block_expert_ids [num_blocks])``, both int32::

        sorted_pair_ids:  [ e0 e0 e0 pad | e3 e3 pad pad | e5 ... ]     (pad = P: masked out)
        block_expert_ids: [     0        |      3        |  5  ... -1 -1 ]  (-1: an unused block)

    Pairs are grouped by expert in increasing expert order, stable (pair order within an expert);
    each group is padded to whole blocks with the id ``P``; ``num_blocks = cdiv(P, block_m) +
    min(P, num_experts)`` bounds the padded groups (a shape-only count: no host sync), and the
    blocks past the last group get expert -1. An expert nobody chose has no block.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs, device = flat.numel(), flat.device
    num_blocks = -(-num_pairs // block_m) + min(num_pairs, num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    group_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - group_start[sorted_experts]
    slots = padded_end[sorted_experts] - padded[sorted_experts] + rank
    sorted_pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[slots] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert_ids = torch.where(block_expert_ids < num_experts, block_expert_ids, -1).to(torch.int32)
    return sorted_pair_ids, block_expert_ids


class PackedExperts(NamedTuple):
    """One projection of every expert in a quantized layout: an argument of :func:`quantized_fused_moe`.

    ``data``: ``[E, rows, row_units]`` in the format's storage dtype (GGUF: uint8 blocks), expert
    ``e``'s ``rows`` output features; ``scales``: the format's side tensor indexed by expert on
    dim 0 (per-group scales, zero points), or None where ``data`` embeds them (GGUF blocks);
    ``quant_type``: the layout, ``"<format>:<type>"`` (``"gguf:Q4_K"``), which a kernel reads to
    know whether it can decode it; ``in_features``: the inputs of each row; ``dequantize(data,
    scales, dtype) -> [n, rows, in_features]``: the format's decoder of ``n`` experts' tensors
    (selected along dim 0), which the torch reference calls and a kernel replaces;
    ``global_scales``: optional float32 ``[E]``, one factor per expert multiplying what
    ``dequantize`` returns (NVFP4's per-tensor global scale), None where the format has none.
    """

    data: Tensor
    scales: Tensor | None
    quant_type: str
    in_features: int
    dequantize: Callable[[Tensor, Tensor | None, torch.dtype], Tensor]
    global_scales: Tensor | None = None

    def experts(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """The dense weights ``[len(ids), rows, in_features]`` of experts ``ids`` (any order, repeats allowed)."""
        scales = None if self.scales is None else self.scales.index_select(0, ids)
        if self.global_scales is None:
            return self.dequantize(self.data.index_select(0, ids), scales, dtype)
        weights = self.dequantize(self.data.index_select(0, ids), scales, torch.float32)
        return (weights * self.global_scales.index_select(0, ids).float()[:, None, None]).to(dtype)


def quantized_fused_moe(
    hidden: Tensor,
    w1: PackedExperts,
    w3: PackedExperts,
    w2: PackedExperts,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: MoEActivation = PLAIN_SWIGLU,
) -> Tensor:
    """:func:`fused_moe` over experts kept quantized: gate ``w1`` and up ``w3`` ``[E, I, H]``, down
    ``w2`` ``[E, H, I]`` as :class:`PackedExperts` (each projection may have its own type).

    Returns what :func:`fused_moe` returns on the dequantized weights (``w13 = cat(w1, w3)``
    per expert), in ``hidden.dtype``. This reference has two paths:

    * ``T * k <= E`` pairs (decode): gathers the packed tensors of the chosen experts by
      ``topk_ids`` (one per pair), dequantizes only those and multiplies per pair (``bmm``):
      no host sync, so it can run inside a CUDA graph when ``dequantize`` can;
    * more pairs (prefill): loops over the experts that were hit, dequantizing each once;
      syncs with the host once (not CUDA-graphable).

    A kernel registered for this op reads the ``quant_type`` layouts it knows from ``data`` /
    ``scales`` directly (calling this reference for the others) and must give the same result.
    """
    num_tokens, top_k = topk_ids.shape
    num_experts = w1.data.shape[0]
    if num_tokens * top_k > num_experts:

        def weights(expert: int) -> tuple[Tensor, Tensor]:
            ids = torch.tensor([expert], device=hidden.device)
            gate_up = torch.cat([w1.experts(ids, hidden.dtype)[0], w3.experts(ids, hidden.dtype)[0]])
            return gate_up, w2.experts(ids, hidden.dtype)[0]

        return _moe_per_expert(hidden, weights, num_experts, topk_weights, topk_ids, activation)
    ids = topk_ids.reshape(-1).long()  # pair p = token * top_k + j
    x = hidden.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [P, H, 1]
    gate_up = torch.cat([torch.bmm(w1.experts(ids, hidden.dtype), x), torch.bmm(w3.experts(ids, hidden.dtype), x)], 1)
    gate_up = gate_up.squeeze(-1)
    if (bias := activation.bias("w13", ids)) is not None:
        gate_up = gate_up + bias
    act = activation.act(gate_up).unsqueeze(-1)  # [P, I, 1]
    expert_out = torch.bmm(w2.experts(ids, hidden.dtype), act).squeeze(-1)  # [P, H]
    if (bias := activation.bias("w2", ids)) is not None:
        expert_out = expert_out + bias
    expert_out = expert_out.float()
    weighted = expert_out * topk_weights.reshape(-1, 1).float()
    return weighted.view(num_tokens, top_k, -1).sum(1).to(hidden.dtype)


def _moe_per_expert(
    hidden: Tensor,
    weights: Callable[[int], tuple[Tensor, Tensor]],
    num_experts: int,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: MoEActivation = PLAIN_SWIGLU,
) -> Tensor:
    """:func:`fused_moe`'s loop, with expert ``e``'s ``(w13 [2I, H], w2 [H, I])`` from ``weights(e)``."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pair p = token * top_k + j, grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        w13, w2 = weights(expert)
        act = activation.act(F.linear(hidden[tokens], w13, activation.bias("w13", expert)))
        expert_out = F.linear(act, w2, activation.bias("w2", expert)).float()
        expert_out = expert_out * topk_weights.reshape(-1)[pairs, None].float()
        out.index_add_(0, tokens, expert_out)
    return out.to(hidden.dtype)
