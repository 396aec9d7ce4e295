"""GGUF expert stacks multiplied where they lie packed: :func:`quantized_fused_moe` (the kernel
registry's ``quantized_fused_moe`` op on CUDA for ``"gguf:<type>"`` / ``"gguf-planar:<type>"`` experts).

Each projection is ``[E, rows, bytes_per_row]`` uint8: expert ``e``'s rows are one GGUF matrix,
in the file's block layout (``gguf:``) or that matrix's own planar layout (``gguf-planar:``, see
:mod:`.decode`: expert ``e``'s planes start at byte ``e * rows * bytes_per_row``). Weight tiles
are decoded in registers by :func:`decode`, as :mod:`.matmul`'s. Two launches, as the bf16
``fused_moe``, then the ``top_k`` rows of a token summed in float32::

    gate/up:  act[p]      = silu(x[t] @ w1[e]^T) * (x[t] @ w3[e]^T)      pair p = t * top_k + j, e = topk_ids[t, j]
    down:     per_pair[p] = (act[p] @ w2[e]^T) * topk_weights[t, j]

(GeGLU experts, Gemma 4's: ``gelu_tanh`` in place of ``silu``), with the projections rounded to
x's dtype before the activation and before the routing weight, as the reference rounds them. Two forms, by the constexpr ``BLOCK_M`` (:class:`MoEKernelConfig`):

* ``BLOCK_M == 1`` (decode): one program per (pair, ``BLOCK_N`` rows), the pair's expert read
  from ``topk_ids``: no sort; the rows are streamed once per pair and multiplied elementwise in
  fp32. Only the chosen experts' bytes are read;
* ``BLOCK_M >= 16``: the pairs grouped into blocks of one expert by the ``moe_align_block_size``
  op (kernel registry), every block's expert rows decoded once per K step, cast to x's dtype and
  multiplied on the tensor cores (``tl.dot``, fp32 accumulation); an expert nobody chose has no
  block and is never read.

Up to :data:`~fw_gguf.kernels.moe_int8.INT8_MAX_TOKENS` tokens, planar Q4_K / Q6_K / Q8_0 stacks
go instead to :mod:`.moe_int8`'s form on integer dot products (x and the act rows rounded to int8
per 32 values, as the dense GEMV rounds them) while :data:`~fw_gguf.kernels.moe_int8.INT8_DECODE`
is on (``FW_GGUF_MOE_INT8=0`` turns it off): :func:`int8_form`.

Grids come from shapes only and nothing syncs with the host or copies from it: every call can be
captured in a CUDA graph. Launch settings are static per shape: :data:`MOE_TUNED` (measured per GPU
model by ``benchmarks/gguf_kernels.py --moe --sweep``), else :func:`moe_config`'s rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor

from framework import ops
from framework.ops import PLAIN_SWIGLU, MoEActivation, PackedExperts
from framework.quantized_moe import kernel_can_run, pair_blocks, two_launches
from fw_gguf.kernels import moe_int8
from fw_gguf.kernels.decode import GROUPS, KERNEL_TYPES, decode_weights
from fw_gguf.kernels.moe_int8 import Int8MoEConfig, int8_fused_moe, int8_supported

#: ``PackedExperts.quant_type`` prefixes of GGUF stacks: the file's block layout, planar per expert.
LAYOUTS = {"gguf": False, "gguf-planar": True}


@dataclass(frozen=True)
class MoEKernelConfig:
    """One launch shape of :func:`quantized_fused_moe`: pairs per program (1: per-pair elementwise
    GEMV, >= 16: sorted blocks on ``tl.dot``), output rows per program of the gate/up and of the
    down launch, K values per step (a multiple of 256: whole blocks of every type), warps, stages."""

    block_m: int
    block_n_gate_up: int
    block_n_down: int
    k_step: int = 256
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.block_m != 1 and (self.block_m < 16 or self.block_m & (self.block_m - 1)):
            raise ValueError(f"block_m is 1 (per-pair GEMV) or a power of two >= 16, not {self.block_m}")
        if self.k_step % 256 or self.k_step & (self.k_step - 1):
            raise ValueError(
                f"k_step is a power-of-two multiple of 256 (whole blocks of every type), not {self.k_step}"
            )


def moe_config(num_pairs: int) -> MoEKernelConfig:
    """The static rule for ``num_pairs`` (token, expert) pairs: the per-pair GEMV up to 64 pairs
    (8 tokens at top-8), 16-row tensor-core blocks up to 256, 32-row blocks beyond. Each is a
    shape ptxas compiles for sm_90 without spilling registers at Q4_K gate/up and Q6_K down (the
    gate/up kernel holds two decoded tiles and two accumulators: 64-row blocks, or 64-wide ones on
    4 warps, spill)."""
    if num_pairs <= 64:
        return MoEKernelConfig(block_m=1, block_n_gate_up=16, block_n_down=32, num_warps=4, num_stages=2)
    if num_pairs <= 256:
        return MoEKernelConfig(block_m=16, block_n_gate_up=32, block_n_down=64, num_warps=8, num_stages=2)
    return MoEKernelConfig(block_m=32, block_n_gate_up=32, block_n_down=32, num_warps=8, num_stages=2)


#: Settings measured on a GPU model (``benchmarks/gguf_kernels.py --moe --sweep`` prints entries):
#: ``(device name, gate type, down type, E, H, I, pair bucket) -> setting``; the bucket is
#: :func:`pair_bucket`'s. Shapes not listed use :func:`moe_config`'s rule.
MOE_TUNED: dict[tuple[str, str, str, int, int, int, int], MoEKernelConfig] = {}


def pair_bucket(num_pairs: int) -> int:
    """The pairs a tuned setting is measured at and used for: up to 8, 64, 512, more (4096)."""
    return 8 if num_pairs <= 8 else 64 if num_pairs <= 64 else 512 if num_pairs <= 512 else 4096


@triton.jit
def _step(
    acc,
    x_ptr,
    x_off,
    x_mask,
    k0,
    w_ptr,
    n4,
    N,
    K,
    QTYPE: tl.constexpr,
    PLANAR: tl.constexpr,
    G: tl.constexpr,
    S: tl.constexpr,
    NB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One K step (``NB`` blocks of every row) of ``acc += x @ W^T``, ``W`` ``[N, K]`` at ``w_ptr``.
    ``BLOCK_M == 1``: ``acc`` ``[BLOCK_N, NB, G, S]`` (elementwise), ``x_off`` the offset of x's row;
    else ``acc`` ``[BLOCK_M, BLOCK_N]``, ``x_off`` / ``x_mask`` ``[BLOCK_M]`` rows."""
    QK: tl.constexpr = G * S
    blocks_per_row = K // QK
    kb = k0 // QK + tl.arange(0, NB)[None, :, None, None]
    g4 = tl.arange(0, G)[None, None, :, None]
    s4 = tl.arange(0, S)[None, None, None, :]
    live = kb < blocks_per_row
    w = decode_weights(w_ptr, n4 * blocks_per_row + kb, N * blocks_per_row, g4, s4, (n4 < N) & live, QTYPE, PLANAR)
    if BLOCK_M == 1:
        x = tl.load(x_ptr + x_off + n4 * 0 + kb * QK + g4 * S + s4, mask=live, other=0.0).to(tl.float32)
        acc += w * x
    else:
        ks = k0 + tl.arange(0, NB * QK)
        x = tl.load(x_ptr + x_off[:, None] + ks[None, :], mask=x_mask[:, None] & (ks[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(tl.reshape(w.to(x.dtype), (BLOCK_N, NB * QK))), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _rows(sorted_ids_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's pair ids ``[BLOCK_M]`` and which are real (``BLOCK_M == 1``: the program's pair)."""
    pid_m = tl.program_id(0)
    if BLOCK_M == 1:
        rows = tl.full((1,), pid_m, tl.int32)
    else:
        rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return rows, rows < num_pairs


@triton.jit
def _reduced(acc, BLOCK_M: tl.constexpr):
    """The ``[BLOCK_M, BLOCK_N]`` sums of an accumulator (the elementwise form's: ``[1, BLOCK_N]``)."""
    if BLOCK_M == 1:
        sums = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)[None, :]
    else:
        sums = acc
    return sums


@triton.jit
def _sigmoid(z):
    """``sigmoid(z)`` in float32 by ``exp`` of a non-positive argument only: no overflow."""
    e = tl.exp(-tl.abs(z))
    return tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w1_ptr,
    w3_ptr,
    act_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    top_k,
    H,
    INTER,
    stride_xm,
    stride_w1e,
    stride_w3e,
    QTYPE1: tl.constexpr,
    G1: tl.constexpr,
    S1: tl.constexpr,
    NB1: tl.constexpr,
    QTYPE3: tl.constexpr,
    G3: tl.constexpr,
    S3: tl.constexpr,
    NB3: tl.constexpr,
    PLANAR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    GELU_TANH: tl.constexpr,
):
    """Program (block of pairs, block of ``BLOCK_N`` intermediate features): ``act = silu(gate) * up``
    (``GELU_TANH``: ``gelu_tanh(gate) * up``)."""
    tl.static_assert(NB1 * G1 * S1 == NB3 * G3 * S3, "gate and up step over the same K values")
    BLOCK_K: tl.constexpr = NB1 * G1 * S1
    expert = tl.load(expert_ids_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    rows, valid = _rows(sorted_ids_ptr, num_pairs, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n4 = n[:, None, None, None]
    w1 = w1_ptr + expert * stride_w1e
    w3 = w3_ptr + expert * stride_w3e
    if BLOCK_M == 1:
        x_off = (tl.program_id(0) // top_k) * stride_xm
        acc1 = tl.zeros((BLOCK_N, NB1, G1, S1), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, NB3, G3, S3), dtype=tl.float32)
    else:
        x_off = (rows // top_k) * stride_xm
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        acc1 = _step(
            acc1, x_ptr, x_off, valid, k0, w1, n4, INTER, H, QTYPE1, PLANAR, G1, S1, NB1, BLOCK_M, BLOCK_N, PRECISION
        )
        acc3 = _step(
            acc3, x_ptr, x_off, valid, k0, w3, n4, INTER, H, QTYPE3, PLANAR, G3, S3, NB3, BLOCK_M, BLOCK_N, PRECISION
        )
    out_dtype = act_ptr.dtype.element_ty
    gate = _reduced(acc1, BLOCK_M).to(out_dtype).to(tl.float32)
    up = _reduced(acc3, BLOCK_M).to(out_dtype).to(tl.float32)
    if GELU_TANH:  # 0.5 g (1 + tanh(z)) == g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3)
        gated = gate * _sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
    else:
        gated = gate * _sigmoid(gate)
    # the activation rounded as F.silu's / F.gelu's result is, then the product (the reference's two roundings)
    act = gated.to(out_dtype).to(tl.float32) * up
    tl.store(
        act_ptr + rows[:, None] * INTER + n[None, :], act.to(out_dtype), mask=valid[:, None] & (n[None, :] < INTER)
    )


@triton.jit
def _down_kernel(
    act_ptr,
    w2_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    H,
    INTER,
    stride_w2e,
    QTYPE: tl.constexpr,
    G: tl.constexpr,
    S: tl.constexpr,
    NB: tl.constexpr,
    PLANAR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (block of pairs, block of ``BLOCK_N`` hidden features): ``out = (act @ w2^T) * weight``."""
    BLOCK_K: tl.constexpr = NB * G * S
    expert = tl.load(expert_ids_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    rows, valid = _rows(sorted_ids_ptr, num_pairs, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n4 = n[:, None, None, None]
    w2 = w2_ptr + expert * stride_w2e
    if BLOCK_M == 1:
        x_off = tl.program_id(0) * INTER
        acc = tl.zeros((BLOCK_N, NB, G, S), dtype=tl.float32)
    else:
        x_off = rows * INTER
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        acc = _step(
            acc, act_ptr, x_off, valid, k0, w2, n4, H, INTER, QTYPE, PLANAR, G, S, NB, BLOCK_M, BLOCK_N, PRECISION
        )
    out_dtype = out_ptr.dtype.element_ty
    routing = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    out = _reduced(acc, BLOCK_M).to(out_dtype).to(tl.float32) * routing[:, None]
    tl.store(out_ptr + rows[:, None] * H + n[None, :], out.to(out_dtype), mask=valid[:, None] & (n[None, :] < H))


def parse_quant_type(quant_type: str) -> tuple[bool, GGMLQuantizationType] | None:
    """``(planar, type)`` of a GGUF stack this module multiplies, or None (another format or type)."""
    layout, _, name = quant_type.partition(":")
    if layout not in LAYOUTS or name not in GGMLQuantizationType.__members__:
        return None
    qtype = GGMLQuantizationType[name]
    return (LAYOUTS[layout], qtype) if qtype in KERNEL_TYPES else None


def supports(
    hidden: Tensor, w1: PackedExperts, w3: PackedExperts, w2: PackedExperts, activation: MoEActivation = PLAIN_SWIGLU
) -> bool:
    """Whether :func:`quantized_fused_moe` runs these in its kernels (else it calls the reference):
    GGUF stacks of kernel types, gate and up in one layout, and what
    :func:`framework.quantized_moe.kernel_can_run` takes with GeGLU (SwiGLU or GeGLU without
    biases, float activations, on CUDA or under ``TRITON_INTERPRET=1``)."""
    parsed = [parse_quant_type(p.quant_type) for p in (w1, w3, w2)]
    return all(parsed) and parsed[0][0] == parsed[1][0] and kernel_can_run(hidden, activation, gelu_tanh=True)


def launch_setting(w1: PackedExperts, w2: PackedExperts, num_pairs: int, device: torch.device) -> MoEKernelConfig:
    """What :func:`quantized_fused_moe` launches: the measured setting (:data:`MOE_TUNED`), else the rule."""
    if MOE_TUNED:
        from fw_gguf.kernels.matmul import _device_name

        experts, inter = w1.data.shape[0], w1.data.shape[1]
        key = (
            _device_name(device),
            w1.quant_type.partition(":")[2],
            w2.quant_type.partition(":")[2],
            experts,
            w1.in_features,
            inter,
            pair_bucket(num_pairs),
        )
        tuned = MOE_TUNED.get(key)
        if tuned is not None:
            return tuned
    return moe_config(num_pairs)


def int8_form(num_tokens: int, w1: PackedExperts, w3: PackedExperts, w2: PackedExperts) -> bool:
    """Whether :func:`quantized_fused_moe` (no ``config``) runs :mod:`.moe_int8`'s integer form for
    ``num_tokens``: on (:data:`~fw_gguf.kernels.moe_int8.INT8_DECODE`), a decode batch (up to
    :data:`~fw_gguf.kernels.moe_int8.INT8_MAX_TOKENS`) and stacks it takes."""
    return moe_int8.INT8_DECODE and num_tokens <= moe_int8.INT8_MAX_TOKENS and int8_supported(w1, w3, w2)


def _check_stack(packed: PackedExperts, qtype: GGMLQuantizationType) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    experts, rows, row_bytes = packed.data.shape
    if (
        packed.data.dtype != torch.uint8
        or not packed.data.is_contiguous()
        or packed.in_features % block_size
        or row_bytes != packed.in_features // block_size * type_size
    ):
        raise ValueError(
            f"{packed.quant_type} experts need contiguous uint8 [E, rows, {packed.in_features} // "
            f"{block_size} * {type_size}] bytes; got {packed.data.dtype} {tuple(packed.data.shape)}"
        )
    if rows * row_bytes >= 2**31 or rows * packed.in_features >= 2**31:
        raise ValueError(
            f"{packed.quant_type} [{rows}, {packed.in_features}] per expert: the kernels' offsets "
            "are 32-bit within an expert"
        )


def _type_meta(qtype: GGMLQuantizationType, k_step: int, suffix: str = "") -> dict[str, int]:
    groups, size = GROUPS[qtype]
    return {
        f"QTYPE{suffix}": int(qtype),
        f"G{suffix}": groups,
        f"S{suffix}": size,
        f"NB{suffix}": k_step // (groups * size),
    }


def quantized_fused_moe(
    hidden: Tensor,
    w1: PackedExperts,
    w3: PackedExperts,
    w2: PackedExperts,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: MoEActivation = PLAIN_SWIGLU,
    *,
    config: MoEKernelConfig | Int8MoEConfig | None = None,
) -> Tensor:
    """:func:`framework.ops.quantized_fused_moe` for GGUF stacks (:func:`supports`); anything else
    by the reference. ``config`` overrides :func:`int8_form` and :func:`launch_setting` (benchmarks,
    tests): an :class:`~fw_gguf.kernels.moe_int8.Int8MoEConfig` runs the integer form, a
    :class:`MoEKernelConfig` this module's. Returns a new ``[T, H]`` tensor of ``hidden.dtype``;
    raises ``ValueError`` for stacks whose bytes do not match their ``in_features``, or an
    ``Int8MoEConfig`` for stacks the integer form does not take."""
    if not supports(hidden, w1, w3, w2, activation):
        return ops.quantized_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, activation)
    (planar13, type1), (_, type3), (planar2, type2) = (parse_quant_type(p.quant_type) for p in (w1, w3, w2))
    for packed, qtype in ((w1, type1), (w3, type3), (w2, type2)):
        _check_stack(packed, qtype)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w1.data.shape[0], w1.data.shape[1]
    top_k = topk_ids.shape[1]
    expected = {
        "w1": (num_experts, inter, hidden_size),
        "w3": (num_experts, inter, hidden_size),
        "w2": (num_experts, hidden_size, inter),
    }
    for name, packed in (("w1", w1), ("w3", w3), ("w2", w2)):
        if (*packed.data.shape[:2], packed.in_features) != expected[name]:
            raise ValueError(
                f"{name}: expected {expected[name][0]} experts of [{expected[name][1]}, "
                f"{expected[name][2]}] for hidden {hidden_size} and width {inter}, got "
                f"{packed.data.shape[0]} of [{packed.data.shape[1]}, {packed.in_features}]"
            )
    if num_tokens == 0:
        return torch.empty_like(hidden)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    if isinstance(config, Int8MoEConfig) or (config is None and int8_form(num_tokens, w1, w3, w2)):
        if not int8_supported(w1, w3, w2):
            raise ValueError(
                f"the integer MoE form takes planar Q4_K / Q6_K / Q8_0 stacks with 4-byte aligned planes; "
                f"got {w1.quant_type}, {w3.quant_type}, {w2.quant_type}"
            )
        return int8_fused_moe(hidden, w1, w3, w2, topk_weights, topk_ids, activation, config)
    config = config or launch_setting(w1, w2, num_tokens * top_k, hidden.device)
    pairs = pair_blocks(topk_ids, num_experts, config.block_m, sorted=config.block_m != 1)
    common = dict(
        BLOCK_M=config.block_m,
        PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )

    def gate_up(act: Tensor) -> None:
        _gate_up_kernel[(pairs.num_programs, triton.cdiv(inter, config.block_n_gate_up))](
            hidden,
            w1.data,
            w3.data,
            act,
            pairs.sorted_ids,
            pairs.expert_ids,
            pairs.num_pairs,
            top_k,
            hidden_size,
            inter,
            hidden.stride(0),
            w1.data.stride(0),
            w3.data.stride(0),
            PLANAR=planar13,
            BLOCK_N=config.block_n_gate_up,
            GELU_TANH=activation.gelu_tanh,
            **_type_meta(type1, config.k_step, "1"),
            **_type_meta(type3, config.k_step, "3"),
            **common,
        )

    def down(act: Tensor, per_pair: Tensor, weights: Tensor) -> None:
        _down_kernel[(pairs.num_programs, triton.cdiv(hidden_size, config.block_n_down))](
            act,
            w2.data,
            per_pair,
            weights,
            pairs.sorted_ids,
            pairs.expert_ids,
            pairs.num_pairs,
            hidden_size,
            inter,
            w2.data.stride(0),
            PLANAR=planar2,
            BLOCK_N=config.block_n_down,
            **_type_meta(type2, config.k_step),
            **common,
        )

    return two_launches(hidden, topk_weights, topk_ids, inter, gate_up, down)


#: The ``PackedExperts.quant_type`` values this implementation multiplies in its kernels.
quantized_fused_moe.quant_types = frozenset(f"{layout}:{t.name}" for layout in LAYOUTS for t in KERNEL_TYPES)
