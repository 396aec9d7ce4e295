"""GPTQ / AWQ / compressed-tensors experts multiplied where they lie packed: :func:`quantized_fused_moe`
(the kernel registry's ``quantized_fused_moe`` op on CUDA for ``"wna16:<bits>bit:..."`` experts).

Each projection is :class:`~fw_gptq.moe.WNA16FusedMoEMethod`'s stack::

    data   int32 [E, K/pf, N]       value k of column n in word k // pf, bits (k % pf) * bits  (pf = 32 // bits)
    side   float32 [E, 2*G*N + K]   scales [G, N] | zero points [G, N] | g_idx [K] (as floats), per expert

and ``quant_type`` says how a weight finds its group: ``wna16:4bit:g128`` (``k // 128``: scales read
once per slice of inputs where the slice lies in one group), ``wna16:4bit:perm128`` (act-order experts
sorted by group at load: the same, with the activations gathered through the expert's ``perm``) or
``wna16:4bit:g_idx`` (any other grouping: the expert's group looked up per input feature). The two
launches (gate/up with SiLU-and-mul, then down times the routing weight), their two forms (unsorted
per pair up to :data:`SORTED_MIN_PAIRS` pairs, sorted blocks of one expert beyond) and the buffers
between them are :mod:`framework.quantized_moe`'s; the projections are rounded to x's dtype before
SiLU-and-mul and before the routing weight, as the reference rounds them.

A program covers ``BLOCK_M`` pairs of one expert and ``BLOCK_N`` outputs; the weight is unpacked as the
dense core's (:mod:`fw_gptq.kernels.wna16`: each word loaded once, shifts, no integer-to-float
conversion, a zero *tensor*, 128-wide tiles) and is the LEFT operand of ``tl.dot`` (``acc`` is out^T),
which Hopper's wgmma reads from registers. Unsorted, x's row is padded to 16 (``tl.dot``'s smallest
tile). Grids come from shapes only and nothing syncs with the host: every call can be captured in a
CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl
from torch import Tensor

from framework import ops, quantized_moe
from framework.ops import PLAIN_SWIGLU, MoEActivation, PackedExperts
from framework.quantized_moe import SORTED_MIN_PAIRS, kernel_can_run, pair_blocks, two_launches


@dataclass(frozen=True)
class MoEKernelConfig(quantized_moe.MoEKernelConfig):
    """:class:`framework.quantized_moe.MoEKernelConfig` with this kernel's defaults; ``sub_k`` (an
    unpacked slice) is a power of two >= 32, whole words of either bit width."""

    MIN_SUB_K: ClassVar[int] = 32

    block_n: int = 128
    block_k: int = 256


def moe_config(num_pairs: int, group_size: int = 128, act_order: bool = False) -> MoEKernelConfig:
    """The static rule for ``num_pairs`` pairs: unsorted up to 64 pairs (8 tokens at top-8) in 256-input
    steps, then 16-row sorted blocks up to 256 pairs and 32-row blocks beyond, one slice a step. Slices
    are 128 inputs, or the group where it is smaller (so each slice's scales are one row). ``act_order``:
    groups looked up per input (``g_idx`` stacks; sorted ``perm`` stacks are not this case), a scale and
    a zero read per weight: 32-input slices, 64-input steps, two stages (what fits an SM's shared memory)."""
    sub_k = 32 if act_order else max(32, min(128, group_size))
    stages = 2 if act_order else 3
    if num_pairs < SORTED_MIN_PAIRS:
        return MoEKernelConfig(
            sorted=False, block_k=64 if act_order else max(256, sub_k), sub_k=sub_k, num_stages=stages
        )
    block_m = 16 if num_pairs <= 256 else 32
    return MoEKernelConfig(sorted=True, block_m=block_m, block_k=sub_k, sub_k=sub_k, num_stages=stages)


@triton.jit
def _weight_slice(
    w_ptr,
    side_ptr,
    ks0,
    K,
    N,
    G,
    offs_n,
    mask_n,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    ACT_ORDER: tl.constexpr,
    SCALE_PER_SLICE: tl.constexpr,
    SUB_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``W^T[ks0 : ks0 + SUB_K, offs_n]`` of one expert in float32, ``(q - zero) * scale`` exactly (zero
    past K or outside ``mask_n``). ``(q | bits of 2**23)`` read as a float is ``2**23 + q``: the quants
    become floats without a conversion instruction, and the subtraction of ``2**23 + zero`` is exact."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_w = ks0 // PACK + tl.arange(0, SUB_K // PACK)
    words = tl.load(
        w_ptr + offs_w[:, None] * N + offs_n[None, :], mask=(offs_w[:, None] < K // PACK) & mask_n[None, :], other=0
    )
    shifts = tl.arange(0, PACK) * BITS
    q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & MASK, (SUB_K, BLOCK_N))
    biased = (q | 0x4B000000).to(tl.float32, bitcast=True)
    zeros_ptr = side_ptr + G * N
    if SCALE_PER_SLICE:
        group = ks0 // GROUP_SIZE
        live = mask_n & (offs_n * 0 + ks0 < K)  # a step may reach past K: its slices there read no scales
        scale = tl.load(side_ptr + group * N + offs_n, mask=live, other=0.0)[None, :]
        zero = tl.load(zeros_ptr + group * N + offs_n, mask=live, other=0.0)[None, :]
    else:
        offs_k = ks0 + tl.arange(0, SUB_K)
        mask_k = offs_k < K
        if ACT_ORDER:
            groups = tl.load(side_ptr + 2 * G * N + offs_k, mask=mask_k, other=0.0).to(tl.int32)
        else:
            groups = offs_k // GROUP_SIZE
        at = groups[:, None] * N + offs_n[None, :]
        both = mask_k[:, None] & mask_n[None, :]
        scale = tl.load(side_ptr + at, mask=both, other=0.0)
        zero = tl.load(zeros_ptr + at, mask=both, other=0.0)
    return (biased - (zero + 8388608.0)) * scale


@triton.jit
def _pairs(sorted_ids_ptr, num_pairs, SORTED: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's pair ids ``[BLOCK_M]`` and which are real (unsorted: the program's one pair)."""
    offs = tl.arange(0, BLOCK_M)
    if SORTED:
        rows = tl.load(sorted_ids_ptr + tl.program_id(0) * BLOCK_M + offs)
        valid = rows < num_pairs
    else:
        rows = tl.program_id(0) + offs * 0
        valid = offs == 0
    return rows, valid


@triton.jit
def _multiply(
    acc,
    x_ptr,
    x_rows,
    valid,
    ks0,
    K,
    w_ptr,
    side_ptr,
    N,
    G,
    offs_n,
    mask_n,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    ACT_ORDER: tl.constexpr,
    GATHER_X: tl.constexpr,
    SCALE_PER_SLICE: tl.constexpr,
    FP32: tl.constexpr,
    SUB_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``acc [BLOCK_N, BLOCK_M] += W[offs_n, slice] @ x[x_rows, slice]^T`` for one SUB_K slice (``GATHER_X``:
    the slice's inputs are ``perm[slice]``, the side row's last ``K`` values)."""
    w = _weight_slice(
        w_ptr, side_ptr, ks0, K, N, G, offs_n, mask_n, BITS, GROUP_SIZE, ACT_ORDER, SCALE_PER_SLICE, SUB_K, BLOCK_N
    )
    offs_k = ks0 + tl.arange(0, SUB_K)
    mask_k = offs_k < K
    if GATHER_X:  # the words hold input perm[k] at k: the activations follow
        inputs = tl.load(side_ptr + 2 * G * N + offs_k, mask=mask_k, other=0.0).to(tl.int32)
    else:
        inputs = offs_k
    x_t = tl.load(x_ptr + x_rows[None, :] + inputs[:, None], mask=valid[None, :] & mask_k[:, None], other=0.0)
    if FP32:
        acc += tl.dot(tl.trans(w), x_t, input_precision="ieee")
    else:
        acc += tl.dot(tl.trans(w).to(x_t.dtype), x_t)
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w1_ptr,
    w3_ptr,
    side1_ptr,
    side3_ptr,
    act_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    top_k,
    H,
    INTER,
    G,
    stride_xm,
    stride_we,
    stride_se,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    ACT_ORDER: tl.constexpr,
    GATHER_X: tl.constexpr,
    SCALE_PER_SLICE: tl.constexpr,
    FP32: tl.constexpr,
    SORTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
):
    """Program (pairs, ``BLOCK_N`` intermediate features): ``act = silu(x @ w1^T) * (x @ w3^T)``."""
    expert = tl.load(expert_ids_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    rows, valid = _pairs(sorted_ids_ptr, num_pairs, SORTED, BLOCK_M)
    x_rows = (rows // top_k) * stride_xm
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    w1, w3 = w1_ptr + expert * stride_we, w3_ptr + expert * stride_we
    side1, side3 = side1_ptr + expert * stride_se, side3_ptr + expert * stride_se
    acc1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        for sub in tl.static_range(BLOCK_K // SUB_K):
            ks0 = k0 + sub * SUB_K
            acc1 = _multiply(
                acc1,
                x_ptr,
                x_rows,
                valid,
                ks0,
                H,
                w1,
                side1,
                INTER,
                G,
                offs_n,
                mask_n,
                BITS,
                GROUP_SIZE,
                ACT_ORDER,
                GATHER_X,
                SCALE_PER_SLICE,
                FP32,
                SUB_K,
                BLOCK_N,
            )
            acc3 = _multiply(
                acc3,
                x_ptr,
                x_rows,
                valid,
                ks0,
                H,
                w3,
                side3,
                INTER,
                G,
                offs_n,
                mask_n,
                BITS,
                GROUP_SIZE,
                ACT_ORDER,
                GATHER_X,
                SCALE_PER_SLICE,
                FP32,
                SUB_K,
                BLOCK_N,
            )
    out_dtype = act_ptr.dtype.element_ty
    gate = acc1.to(out_dtype).to(tl.float32)
    up = acc3.to(out_dtype).to(tl.float32)
    # silu(gate) rounded as F.silu's result is, then the product (the reference's two roundings)
    e = tl.exp(-tl.abs(gate))  # exp of a non-positive argument only: no overflow
    sigmoid = tl.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    act = (gate * sigmoid).to(out_dtype).to(tl.float32) * up
    tl.store(
        act_ptr + rows[None, :] * INTER + offs_n[:, None], act.to(out_dtype), mask=valid[None, :] & mask_n[:, None]
    )


@triton.jit
def _down_kernel(
    act_ptr,
    w2_ptr,
    side2_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    H,
    INTER,
    G,
    stride_we,
    stride_se,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    ACT_ORDER: tl.constexpr,
    GATHER_X: tl.constexpr,
    SCALE_PER_SLICE: tl.constexpr,
    FP32: tl.constexpr,
    SORTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
):
    """Program (pairs, ``BLOCK_N`` hidden features): ``out = (act @ w2^T) * routing weight``."""
    expert = tl.load(expert_ids_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    rows, valid = _pairs(sorted_ids_ptr, num_pairs, SORTED, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    w2, side2 = w2_ptr + expert * stride_we, side2_ptr + expert * stride_se
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        for sub in tl.static_range(BLOCK_K // SUB_K):
            acc = _multiply(
                acc,
                act_ptr,
                rows * INTER,
                valid,
                k0 + sub * SUB_K,
                INTER,
                w2,
                side2,
                H,
                G,
                offs_n,
                mask_n,
                BITS,
                GROUP_SIZE,
                ACT_ORDER,
                GATHER_X,
                SCALE_PER_SLICE,
                FP32,
                SUB_K,
                BLOCK_N,
            )
    out_dtype = out_ptr.dtype.element_ty
    routing = tl.load(weights_ptr + rows, mask=valid, other=0.0)
    out = acc.to(out_dtype).to(tl.float32) * routing[None, :]
    tl.store(out_ptr + rows[None, :] * H + offs_n[:, None], out.to(out_dtype), mask=valid[None, :] & mask_n[:, None])


def parse_quant_type(quant_type: str) -> tuple[int, int | None, bool] | None:
    """``(bits, group_size, gather)`` of a stack this module multiplies (``group_size`` None: each
    input's group looked up; ``gather``: act-order experts sorted by group, ``perm<size>``), or None
    (another format)."""
    parts = quant_type.split(":")
    if len(parts) != 3 or parts[0] != "wna16" or parts[1] not in ("4bit", "8bit"):
        return None
    bits, grouping = int(parts[1][0]), parts[2]
    if grouping == "g_idx":
        return bits, None, False
    for prefix in ("g", "perm"):
        size = grouping[len(prefix) :]
        if grouping.startswith(prefix) and size.isdigit() and int(size) > 0:
            return bits, int(size), prefix == "perm"
    return None


def supports(
    hidden: Tensor, w1: PackedExperts, w3: PackedExperts, w2: PackedExperts, activation: MoEActivation = PLAIN_SWIGLU
) -> bool:
    """Whether :func:`quantized_fused_moe` runs these in its kernels (else it calls the reference):
    wna16 stacks of one bit width, gate and up grouped alike, plain SwiGLU without biases, float
    activations, on CUDA (or under ``TRITON_INTERPRET=1``)."""
    parsed = [parse_quant_type(p.quant_type) for p in (w1, w3, w2)]
    return (
        all(parsed) and parsed[0] == parsed[1] and parsed[0][0] == parsed[2][0] and kernel_can_run(hidden, activation)
    )


def _groups(packed: PackedExperts, name: str, rows: int, cols: int, bits: int) -> int:
    """The stack's groups ``G``, after checking its words and side rows against ``[E, cols / pf, rows]``."""
    experts, words, n = packed.data.shape
    side = packed.scales
    if (
        packed.data.dtype != torch.int32
        or (words * (32 // bits), n) != (cols, rows)
        or side is None
        or side.dtype != torch.float32
        or side.dim() != 2
        or side.shape[0] != experts
        or (side.shape[1] - cols) % (2 * rows)
        or side.shape[1] <= cols
    ):
        raise ValueError(
            f"{name}: expected int32 words [E, {cols} // {32 // bits}, {rows}] and float32 side rows "
            f"[E, 2 * G * {rows} + {cols}]; got {packed.data.dtype} {tuple(packed.data.shape)} and "
            f"{None if side is None else (side.dtype, tuple(side.shape))}"
        )
    return (side.shape[1] - cols) // (2 * rows)


def quantized_fused_moe(
    hidden: Tensor,
    w1: PackedExperts,
    w3: PackedExperts,
    w2: PackedExperts,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: MoEActivation = PLAIN_SWIGLU,
    *,
    config: MoEKernelConfig | None = None,
) -> Tensor:
    """:func:`framework.ops.quantized_fused_moe` for wna16 stacks (:func:`supports`); anything else by
    the reference. ``config`` overrides :func:`moe_config` (benchmarks, tests). Returns a new ``[T, H]``
    tensor of ``hidden.dtype``; raises ``ValueError`` for stacks whose shapes do not fit together."""
    if not supports(hidden, w1, w3, w2, activation):
        return ops.quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, activation)
    (bits, group13, gather13), _, (_, group2, gather2) = (parse_quant_type(p.quant_type) for p in (w1, w3, w2))
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w1.data.shape[0], w1.data.shape[2]
    top_k = topk_ids.shape[1]
    groups = [
        _groups(p, name, rows, cols, bits)
        for p, name, rows, cols in (
            (w1, "w1", inter, hidden_size),
            (w3, "w3", inter, hidden_size),
            (w2, "w2", hidden_size, inter),
        )
    ]
    if (
        w2.data.shape[0] != num_experts
        or w3.data.shape[0] != num_experts
        or w1.data.stride() != w3.data.stride()
        or w1.scales.stride() != w3.scales.stride()
        or groups[0] != groups[1]
    ):
        raise ValueError(f"w1, w3 and w2 must hold {num_experts} experts each, gate and up stacks alike")
    if num_tokens == 0:
        return torch.empty_like(hidden)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    config = config or moe_config(
        num_tokens * top_k, min(g for g in (group13, group2, 128) if g is not None), group13 is None or group2 is None
    )
    pairs = pair_blocks(topk_ids, num_experts, config.block_m, config.sorted)

    def grouping(group: int | None, gather: bool, k: int) -> dict:
        """Grouping constexprs, and the K step of a launch over ``k`` inputs."""
        return dict(
            GROUP_SIZE=group or k,  # act-order: unused
            ACT_ORDER=group is None,
            GATHER_X=gather,
            SCALE_PER_SLICE=group is not None and group % config.sub_k == 0,
            BLOCK_K=config.k_step(k),
        )

    common = dict(BITS=bits, **config.launch_meta(hidden))

    def gate_up(act: Tensor) -> None:
        _gate_up_kernel[(pairs.num_programs, triton.cdiv(inter, config.block_n))](
            hidden,
            w1.data,
            w3.data,
            w1.scales,
            w3.scales,
            act,
            pairs.sorted_ids,
            pairs.expert_ids,
            pairs.num_pairs,
            top_k,
            hidden_size,
            inter,
            groups[0],
            hidden.stride(0),
            w1.data.stride(0),
            w1.scales.stride(0),
            **grouping(group13, gather13, hidden_size),
            **common,
        )

    def down(act: Tensor, per_pair: Tensor, weights: Tensor) -> None:
        _down_kernel[(pairs.num_programs, triton.cdiv(hidden_size, config.block_n))](
            act,
            w2.data,
            w2.scales,
            per_pair,
            weights,
            pairs.sorted_ids,
            pairs.expert_ids,
            pairs.num_pairs,
            hidden_size,
            inter,
            groups[2],
            w2.data.stride(0),
            w2.scales.stride(0),
            **grouping(group2, gather2, inter),
            **common,
        )

    return two_launches(hidden, topk_weights, topk_ids, inter, gate_up, down)
