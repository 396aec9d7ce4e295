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

    return rotary_embedding(positions, normed(query, q_weight), normed(key, k_weight), head_size, cos_sin_cache,
                            is_neox_style)

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


def fused_moe(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    """The routed experts of a mixture-of-experts block, summed with their routing weights.

    Shapes: ``hidden`` ``[T, H]``; ``w13`` ``[E, 2 * I, H]`` (each expert's gate rows, then its
    up rows); ``w2`` ``[E, H, I]``; ``topk_weights`` ``[T, k]`` (float32) and ``topk_ids``
    ``[T, k]`` (integer, in ``[0, E)``) from a routing function such as
    :func:`framework.layers.fused_moe.select_experts`. For every token ``t`` returns::

        sum_j topk_weights[t, j] * w2[e] @ silu_and_mul(w13[e] @ hidden[t])     with e = topk_ids[t, j]

    Each expert's matmuls and its SwiGLU run in ``hidden.dtype`` (as transformers' experts do);
    the weighted sum is accumulated in float32 and rounded once. Returns ``[T, H]`` of
    ``hidden.dtype``. This reference sorts the (token, expert) pairs by expert and loops over the
    experts that were hit; it syncs with the host once per call (fine on CPU, not CUDA-graphable).
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pair p = token * top_k + j, grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        act = silu_and_mul(F.linear(hidden[tokens], w13[expert]))
        expert_out = F.linear(act, w2[expert]).float() * topk_weights.reshape(-1)[pairs, None].float()
        out.index_add_(0, tokens, expert_out)
    return out.to(hidden.dtype)

