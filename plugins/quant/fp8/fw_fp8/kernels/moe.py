"""FP8 experts multiplied where they lie: :func:`quantized_fused_moe` (the kernel registry's
``quantized_fused_moe`` op on CUDA for ``"fp8:e4m3:<rows>x<cols>"`` experts).

Each projection is :class:`~fw_fp8.moe.Fp8FusedMoEMethod`'s stack::

    data    uint8 (FP8 E4M3 bytes) [E, N, K]
    scales  float32 [E, ceil(N / rows), ceil(K / cols)]     W[e, n, k] = data[e, n, k] * scales[e, n // rows, k // cols]

(block checkpoints: ``128x128``, or ``1x128`` where a shard's rows do not start on a block; channel and
tensor scales: ``1x<K>``). The two launches (gate/up with SiLU-and-mul, then down times the routing
weight), their two forms (unsorted per pair up to :data:`SORTED_MIN_PAIRS` pairs, sorted blocks of one
expert beyond) and the buffers between them are :mod:`framework.quantized_moe`'s; the projections are
rounded to x's dtype before SiLU-and-mul and before the routing weight, as the reference rounds them.

As in the dense W8A16 core (:mod:`fw_fp8.kernels.w8a16`), a program covers ``BLOCK_M`` pairs of one
expert and ``BLOCK_N`` outputs; each ``SUB_K`` slice (never crossing a scale column) of FP8 bytes is
upcast to x's dtype in registers (exact) and is the LEFT operand of ``tl.dot`` (``acc`` is out^T, which
Hopper's wgmma takes from registers); the slice's partial sums are multiplied by one scale per output
feature, so the weights are never materialised. Unsorted, x's row is padded to 16 (``tl.dot``'s
smallest tile). Grids come from shapes only and nothing syncs with the host: every call can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from framework import ops
from framework.ops import PLAIN_SWIGLU, MoEActivation, PackedExperts
from framework.quantized_moe import (
    SORTED_MIN_PAIRS,
    MoEKernelConfig,
    kernel_can_run,
    next_power_of_2,
    pair_blocks,
    two_launches,
)


def moe_config(num_pairs: int, scale_cols: int = 128) -> MoEKernelConfig:
    """The launch shape (:class:`~framework.quantized_moe.MoEKernelConfig`; here ``sub_k`` also divides
    the scale columns) by the static rule for ``num_pairs`` pairs: unsorted up to 64 pairs (8 tokens at
    top-8): 64 outputs a program in 512-input steps, as the dense GEMV; then sorted 16-row blocks up to
    256 pairs and 32-row blocks beyond, 128 outputs, one slice a step. Slices are 128 inputs (or the
    scale columns, where they are narrower)."""
    sub_k = max(16, min(128, scale_cols))
    if num_pairs < SORTED_MIN_PAIRS:
        return MoEKernelConfig(sorted=False, block_n=64, block_k=max(512, sub_k), sub_k=sub_k, num_stages=3)
    block_m = 16 if num_pairs <= 256 else 32
    return MoEKernelConfig(sorted=True, block_m=block_m, block_n=128, block_k=sub_k, sub_k=sub_k, num_stages=3)


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
    scale_ptr,
    stride_sn,
    offs_n,
    mask_n,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    FP32: tl.constexpr,
    SUB_K: tl.constexpr,
):
    """``acc [BLOCK_N, BLOCK_M] += (W[offs_n, slice] @ x[x_rows, slice]^T) * scale[offs_n, slice]``."""
    offs_k = ks0 + tl.arange(0, SUB_K)
    mask_k = offs_k < K
    w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    live = mask_n & (offs_n * 0 + ks0 < K)  # a step may reach past K: its slices there read no scales
    scale = tl.load(scale_ptr + (offs_n // SCALE_ROWS) * stride_sn + ks0 // SCALE_COLS, mask=live, other=0.0)
    x_t = tl.load(x_ptr + x_rows[None, :] + offs_k[:, None], mask=valid[None, :] & mask_k[:, None], other=0.0)
    if FP32:
        part = tl.dot(w.to(tl.float32), x_t, input_precision="ieee")
    else:
        part = tl.dot(w.to(x_t.dtype), x_t)
    return acc + part * scale[:, None]


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w1_ptr,
    w3_ptr,
    s1_ptr,
    s3_ptr,
    act_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    top_k,
    H,
    INTER,
    stride_xm,
    stride_we,
    stride_se,
    stride_sn,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
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
    s1, s3 = s1_ptr + expert * stride_se, s3_ptr + expert * stride_se
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
                s1,
                stride_sn,
                offs_n,
                mask_n,
                SCALE_ROWS,
                SCALE_COLS,
                FP32,
                SUB_K,
            )
            acc3 = _multiply(
                acc3,
                x_ptr,
                x_rows,
                valid,
                ks0,
                H,
                w3,
                s3,
                stride_sn,
                offs_n,
                mask_n,
                SCALE_ROWS,
                SCALE_COLS,
                FP32,
                SUB_K,
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
    s2_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    H,
    INTER,
    stride_we,
    stride_se,
    stride_sn,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
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
    w2, s2 = w2_ptr + expert * stride_we, s2_ptr + expert * stride_se
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
                s2,
                stride_sn,
                offs_n,
                mask_n,
                SCALE_ROWS,
                SCALE_COLS,
                FP32,
                SUB_K,
            )
    out_dtype = out_ptr.dtype.element_ty
    routing = tl.load(weights_ptr + rows, mask=valid, other=0.0)
    out = acc.to(out_dtype).to(tl.float32) * routing[None, :]
    tl.store(out_ptr + rows[None, :] * H + offs_n[:, None], out.to(out_dtype), mask=valid[None, :] & mask_n[:, None])


def parse_quant_type(quant_type: str) -> tuple[int, int] | None:
    """``(scale rows, scale cols)`` of a stack this module multiplies, or None (another format)."""
    parts = quant_type.split(":")
    if len(parts) != 3 or parts[:2] != ["fp8", "e4m3"]:
        return None
    rows, _, cols = parts[2].partition("x")
    if not (rows.isdigit() and cols.isdigit()) or int(rows) < 1 or int(cols) < 1:
        return None
    return int(rows), int(cols)


def supports(
    hidden: Tensor, w1: PackedExperts, w3: PackedExperts, w2: PackedExperts, activation: MoEActivation = PLAIN_SWIGLU
) -> bool:
    """Whether :func:`quantized_fused_moe` runs these in its kernels (else it calls the reference): FP8
    stacks, gate and up scaled alike, plain SwiGLU without biases, float activations, on CUDA (or under
    ``TRITON_INTERPRET=1``)."""
    parsed = [parse_quant_type(p.quant_type) for p in (w1, w3, w2)]
    return all(parsed) and parsed[0] == parsed[1] and kernel_can_run(hidden, activation)


def _check_stack(packed: PackedExperts, name: str, rows: int, cols: int) -> None:
    """Refuse a stack that is not ``[E, rows, cols]`` FP8 bytes with scales of its layout."""
    scale_rows, scale_cols = parse_quant_type(packed.quant_type)
    experts = packed.data.shape[0]
    expected = (experts, -(-rows // scale_rows), -(-cols // scale_cols))
    data, scales = packed.data, packed.scales
    if (
        data.dtype not in (torch.uint8, torch.float8_e4m3fn)
        or tuple(data.shape) != (experts, rows, cols)
        or not data.is_contiguous()
        or scales is None
        or scales.dtype != torch.float32
        or tuple(scales.shape) != expected
        or scales.stride(-1) != 1
    ):
        raise ValueError(
            f"{name}: expected FP8 bytes [E, {rows}, {cols}] and float32 scales {list(expected)} "
            f"({packed.quant_type}); got {data.dtype} {tuple(data.shape)} and "
            f"{None if scales is None else (scales.dtype, tuple(scales.shape))}"
        )


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
    """:func:`framework.ops.quantized_fused_moe` for FP8 stacks (:func:`supports`); anything else by the
    reference. ``config`` overrides :func:`moe_config` (benchmarks, tests). Returns a new ``[T, H]``
    tensor of ``hidden.dtype``; raises ``ValueError`` for stacks whose shapes do not fit together."""
    if not supports(hidden, w1, w3, w2, activation):
        return ops.quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, activation)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w1.data.shape[0], w1.data.shape[1]
    top_k = topk_ids.shape[1]
    for packed, name, rows, cols in (
        (w1, "w1", inter, hidden_size),
        (w3, "w3", inter, hidden_size),
        (w2, "w2", hidden_size, inter),
    ):
        _check_stack(packed, name, rows, cols)
    if w2.data.shape[0] != num_experts or w3.data.shape[0] != num_experts or w1.scales.stride() != w3.scales.stride():
        raise ValueError(f"w1, w3 and w2 must hold {num_experts} experts each, gate and up scales alike")
    if num_tokens == 0:
        return torch.empty_like(hidden)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    layouts = [parse_quant_type(p.quant_type) for p in (w1, w2)]
    # one scale column covering all of K: no slice ever crosses it
    columns = [
        c if s.shape[-1] > 1 else next_power_of_2(k) * 2
        for (_, c), s, k in zip(layouts, (w1.scales, w2.scales), (hidden_size, inter), strict=True)
    ]
    config = config or moe_config(num_tokens * top_k, min(columns))
    if any(c % config.sub_k for c in columns):
        raise ValueError(f"sub_k {config.sub_k} must divide the scale columns {columns}")
    pairs = pair_blocks(topk_ids, num_experts, config.block_m, config.sorted)
    common = config.launch_meta(hidden)
    data = [p.data.view(torch.float8_e4m3fn) for p in (w1, w3, w2)]

    def gate_up(act: Tensor) -> None:
        _gate_up_kernel[(pairs.num_programs, triton.cdiv(inter, config.block_n))](
            hidden,
            data[0],
            data[1],
            w1.scales,
            w3.scales,
            act,
            pairs.sorted_ids,
            pairs.expert_ids,
            pairs.num_pairs,
            top_k,
            hidden_size,
            inter,
            hidden.stride(0),
            data[0].stride(0),
            w1.scales.stride(0),
            w1.scales.stride(1),
            SCALE_ROWS=layouts[0][0],
            SCALE_COLS=columns[0],
            BLOCK_K=config.k_step(hidden_size),
            **common,
        )

    def down(act: Tensor, per_pair: Tensor, weights: Tensor) -> None:
        _down_kernel[(pairs.num_programs, triton.cdiv(hidden_size, config.block_n))](
            act,
            data[2],
            w2.scales,
            per_pair,
            weights,
            pairs.sorted_ids,
            pairs.expert_ids,
            pairs.num_pairs,
            hidden_size,
            inter,
            data[2].stride(0),
            w2.scales.stride(0),
            w2.scales.stride(1),
            SCALE_ROWS=layouts[1][0],
            SCALE_COLS=columns[1],
            BLOCK_K=config.k_step(inter),
            **common,
        )

    return two_launches(hidden, topk_weights, topk_ids, inter, gate_up, down)
