"""The GGUF MoE decode form on integer dot products: :func:`int8_fused_moe`, as :mod:`.gemv` is for
dense layers (llama.cpp's ``mul_mat_vec_q`` with expert ids is the idea).

For a few tokens the MoE layer is bound by the chosen experts' weight bytes. :mod:`.moe`'s
per-pair form decodes every weight to fp32 and multiplies elementwise (~16 instructions per weight
byte); this form streams each planar expert's quant words into ``dp4a`` against the activations
rounded to int8 per 32 values, and applies the group scales to each group's integer sum, as
:func:`fw_gguf.kernels.gemv._step_sums` does (the same code). Two launches, one program per
(pair, ``BLOCK_N`` rows), the pair's expert read from ``topk_ids`` (no sort), then the ``top_k``
rows of a token summed in float32 (:func:`framework.quantized_moe.two_launches`)::

    gate/up:  act[p]      = glu(q(x[t]) @ w1[e]^T, q(x[t]) @ w3[e]^T)      pair p = t * top_k + j, e = topk_ids[t, j]
    down:     per_pair[p] = (q(act[p]) @ w2[e]^T) * topk_weights[t, j]

``q`` is :func:`fw_gguf.kernels.gemv.quantize_x_reference`'s rounding (int8 per 32 values, scale
``max|x| / 127``, round half away from zero); ``glu`` is SiLU (GeGLU: ``gelu_tanh``) of the gate
times the up projection. The projections are rounded to x's dtype before the activation and before
the routing weight, and the activation and the product to x's dtype, as :mod:`.moe` rounds them;
:func:`int8_moe_reference` is the whole computation in torch. Each program quantizes the values of
its K steps itself (x's for gate/up, its pair's ``act`` row for down): the same integers in every
program, so the result does not depend on the launch shape's row blocking.

Built for planar Q4_K, Q6_K and Q8_0 experts (:data:`fw_gguf.kernels.gemv.GEMV_TYPES`; Q4_K_M and
Q8_0 files), each projection of its own type. Deterministic (fixed summation order), grids from
shapes only, no host sync: CUDA-graph safe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor

from framework.ops import PLAIN_SWIGLU, MoEActivation, PackedExperts
from framework.quantized_moe import pair_blocks, two_launches
from fw_gguf.kernels.gemv import GEMV_TYPES, _quantize_x, _step_sums, gemv_supported, quantize_x_reference

#: Up to this many tokens :func:`fw_gguf.kernels.moe.quantized_fused_moe` runs this form (when
#: :data:`INT8_DECODE` is on and the stacks are of :data:`GEMV_TYPES`, planar).
INT8_MAX_TOKENS = 16
#: Whether the integer form is the default for decode batches; ``FW_GGUF_MOE_INT8=0`` / ``1`` sets it.
INT8_DECODE = os.environ.get("FW_GGUF_MOE_INT8", "1") != "0"


@dataclass(frozen=True)
class Int8MoEConfig:
    """One launch shape of :func:`int8_fused_moe`: output rows per program of the gate/up and of the
    down launch, 256-value superblocks per K step of each (8 Q8_0 blocks each), warps, stages."""

    block_n_gate_up: int = 16
    block_n_down: int = 32
    blocks_gate_up: int = 4
    blocks_down: int = 4
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_n_gate_up", "block_n_down", "blocks_gate_up", "blocks_down"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} is a power of two, not {value}")


def int8_supported(w1: PackedExperts, w3: PackedExperts, w2: PackedExperts) -> bool:
    """Whether :func:`int8_fused_moe` takes these stacks: planar, every projection of a type of
    :data:`GEMV_TYPES` whose quant planes are 4-byte aligned within and between experts
    (:func:`fw_gguf.kernels.gemv.gemv_supported` on one expert's matrix)."""
    for packed in (w1, w3, w2):
        layout, _, name = packed.quant_type.partition(":")
        if layout != "gguf-planar" or name not in GGMLQuantizationType.__members__:
            return False
        qtype = GGMLQuantizationType[name]
        rows, cols = packed.data.shape[1], packed.in_features
        if qtype not in GEMV_TYPES or not gemv_supported(qtype, cols, rows * cols // GGML_QUANT_SIZES[qtype][0]):
            return False
    return True


@triton.jit
def _glu(gate, up, out_dtype, GELU_TANH: tl.constexpr):
    """``silu(gate) * up`` (``GELU_TANH``: ``gelu_tanh(gate) * up``) of fp32 values rounded to
    ``out_dtype``: the activation rounded as ``F.silu``'s / ``F.gelu``'s result is, then the product."""
    z = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate) if GELU_TANH else gate
    e = tl.exp(-tl.abs(z))  # sigmoid(z) by exp of a non-positive argument: no overflow
    gated = gate * tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))  # 0.5 g (1 + tanh(z/2)) == g sigmoid(z)
    return (gated.to(out_dtype).to(tl.float32) * up).to(out_dtype)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w1_ptr,
    w3_ptr,
    act_ptr,
    ids_ptr,
    top_k,
    H,
    INTER,
    T1,
    T3,
    stride_xm,
    stride_w1e,
    stride_w3e,
    QTYPE1: tl.constexpr,
    QTYPE3: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NB: tl.constexpr,
    GELU_TANH: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Program (pair, block of ``BLOCK_N`` intermediate features): ``act = glu(gate, up)``. ``T1`` /
    ``T3``: GGUF blocks in one expert's gate / up matrix (the planes' lengths)."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w1 = w1_ptr + expert * stride_w1e
    w3 = w3_ptr + expert * stride_w3e
    x = x_ptr + (pair // top_k).to(tl.int64) * stride_xm
    STEP_K: tl.constexpr = 256 * NB
    acc1 = tl.zeros((BLOCK_N, 8 * NB), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, 8 * NB), dtype=tl.float32)
    for step in range(0, tl.cdiv(H, STEP_K)):
        xw, dx, sxq32, sxq16 = _quantize_x(x, step * STEP_K, H, 8 * NB)
        acc1 += _step_sums(w1, n, INTER, H, T1, step, xw, dx, sxq32, sxq16, QTYPE1, BLOCK_N, NB, EMULATE)
        acc3 += _step_sums(w3, n, INTER, H, T3, step, xw, dx, sxq32, sxq16, QTYPE3, BLOCK_N, NB, EMULATE)
    out_dtype = act_ptr.dtype.element_ty
    gate = tl.sum(acc1, axis=1).to(out_dtype).to(tl.float32)
    up = tl.sum(acc3, axis=1).to(out_dtype).to(tl.float32)
    tl.store(act_ptr + pair.to(tl.int64) * INTER + n, _glu(gate, up, out_dtype, GELU_TANH), mask=n < INTER)


@triton.jit
def _down_kernel(
    act_ptr,
    w2_ptr,
    out_ptr,
    weights_ptr,
    ids_ptr,
    H,
    INTER,
    T,
    stride_w2e,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NB: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Program (pair, block of ``BLOCK_N`` hidden features): ``out = (q(act) @ w2^T) * weight``;
    ``T`` GGUF blocks in one expert's matrix."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w2 = w2_ptr + expert * stride_w2e
    act = act_ptr + pair.to(tl.int64) * INTER
    STEP_K: tl.constexpr = 256 * NB
    acc = tl.zeros((BLOCK_N, 8 * NB), dtype=tl.float32)
    for step in range(0, tl.cdiv(INTER, STEP_K)):
        aw, da, saq32, saq16 = _quantize_x(act, step * STEP_K, INTER, 8 * NB)
        acc += _step_sums(w2, n, H, INTER, T, step, aw, da, saq32, saq16, QTYPE, BLOCK_N, NB, EMULATE)
    out_dtype = out_ptr.dtype.element_ty
    routing = tl.load(weights_ptr + pair).to(tl.float32)
    out = tl.sum(acc, axis=1).to(out_dtype).to(tl.float32) * routing
    tl.store(out_ptr + pair.to(tl.int64) * H + n, out.to(out_dtype), mask=n < H)


def _qtype(packed: PackedExperts) -> GGMLQuantizationType:
    return GGMLQuantizationType[packed.quant_type.partition(":")[2]]


def _blocks(packed: PackedExperts) -> int:
    """GGUF blocks in one expert's matrix of the stack."""
    return packed.data.shape[1] * packed.in_features // GGML_QUANT_SIZES[_qtype(packed)][0]


def int8_fused_moe(
    hidden: Tensor,
    w1: PackedExperts,
    w3: PackedExperts,
    w2: PackedExperts,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: MoEActivation = PLAIN_SWIGLU,
    config: Int8MoEConfig | None = None,
) -> Tensor:
    """The MoE layer on integer dot products for stacks :func:`int8_supported` takes, checked by the
    caller (:func:`fw_gguf.kernels.moe.quantized_fused_moe`: shapes, bytes, a plain SwiGLU or GeGLU
    ``activation``); ``hidden`` ``[T, H]`` with unit stride along H. Returns a new ``[T, H]`` tensor
    of ``hidden.dtype``, :func:`int8_moe_reference`'s values."""
    config = config or Int8MoEConfig()
    hidden_size, inter, top_k = hidden.shape[1], w1.data.shape[1], topk_ids.shape[1]
    pairs = pair_blocks(topk_ids, w1.data.shape[0], 16, sorted=False)
    emulate = os.environ.get("TRITON_INTERPRET") == "1"
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages)

    def gate_up(act: Tensor) -> None:
        _gate_up_kernel[(pairs.num_programs, triton.cdiv(inter, config.block_n_gate_up))](
            hidden,
            w1.data,
            w3.data,
            act,
            pairs.expert_ids,
            top_k,
            hidden_size,
            inter,
            _blocks(w1),
            _blocks(w3),
            hidden.stride(0),
            w1.data.stride(0),
            w3.data.stride(0),
            QTYPE1=int(_qtype(w1)),
            QTYPE3=int(_qtype(w3)),
            BLOCK_N=config.block_n_gate_up,
            NB=config.blocks_gate_up,
            GELU_TANH=activation.gelu_tanh,
            EMULATE=emulate,
            **launch,
        )

    def down(act: Tensor, per_pair: Tensor, weights: Tensor) -> None:
        _down_kernel[(pairs.num_programs, triton.cdiv(hidden_size, config.block_n_down))](
            act,
            w2.data,
            per_pair,
            weights,
            pairs.expert_ids,
            hidden_size,
            inter,
            _blocks(w2),
            w2.data.stride(0),
            QTYPE=int(_qtype(w2)),
            BLOCK_N=config.block_n_down,
            NB=config.blocks_down,
            EMULATE=emulate,
            **launch,
        )

    return two_launches(hidden, topk_weights, topk_ids, inter, gate_up, down)


def int8_moe_reference(
    hidden: Tensor,
    w1: PackedExperts,
    w3: PackedExperts,
    w2: PackedExperts,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: MoEActivation = PLAIN_SWIGLU,
) -> Tensor:
    """What :func:`int8_fused_moe` computes, in torch (per pair, for tests): x and each pair's
    ``act`` rounded by :func:`~fw_gguf.kernels.gemv.quantize_x_reference`, the projections of the
    exactly dequantized experts in float32, rounded to ``hidden.dtype`` where the kernels round."""
    dtype, top_k = hidden.dtype, topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    x = quantize_x_reference(hidden.float()).repeat_interleave(top_k, dim=0).unsqueeze(-1)
    gate = torch.bmm(w1.experts(ids, torch.float32), x).squeeze(-1).to(dtype)
    up = torch.bmm(w3.experts(ids, torch.float32), x).squeeze(-1).to(dtype)
    act = activation.act(torch.cat([gate, up], dim=1)).to(dtype)
    act = quantize_x_reference(act.float()).unsqueeze(-1)
    out = torch.bmm(w2.experts(ids, torch.float32), act).squeeze(-1).to(dtype).float()
    weighted = out * topk_weights.reshape(-1, 1).float()
    return weighted.view(topk_ids.shape[0], top_k, -1).sum(1).to(dtype)
