"""The one-row GGUF GEMV on integer dot products, as llama.cpp's MMVQ: ``out[1, N] = x[1, K] @ W[N, K]^T``.

A decode step multiplies one row of activations by every weight matrix, so it is bound by the
weight bytes it reads: 4.5 bits a value for Q4_K. Decoding each value to fp32 and multiplying
(:func:`fw_gguf.kernels.matmul.gguf_matmul`'s elementwise GEMV) takes ~16 instructions per weight
byte, twice what an H200 SM can issue while its memory streams 16 bytes a cycle. This kernel
instead quantizes x to int8 with one fp32 scale per 32 values (round half away from zero, scale
``max|x| / 127``), and multiplies four packed weight quants by four x quants in one ``dp4a``
instruction, after masking a 32-bit word of nibbles into bytes: ~2 instructions per weight byte.
The per-group weight scales (and the activations' scales) are applied to each group's integer
sum::

    out[n] = sum_g  d_x[g] * (scale[n, g] * sum_{k in g} q[n, k] * x_q[k]  -  offset[n, g] * sum_{k in g} x_q[k])

So the result is that of the exact dequantized weights times x rounded to 8 bits per 32 values
(the activations' rounding llama.cpp's GPU GEMV makes too), not times x itself:
:func:`quantize_x_reference` is the torch form of that rounding, for tests.

Weights are read in the planar layout (:mod:`fw_gguf.kernels.decode`) as 32-bit words: the quant
plane of one row is contiguous over K, so each step of a program streams ``BLOCK_N`` rows x 256
values. Built for Q8_0, Q4_K and Q6_K (the types of Q8_0, Q4_K_M and Q6_K files);
:data:`GEMV_TYPES`. Under the Triton interpreter (no inline PTX) ``dp4a`` is computed with shifts and
multiplies, the same integers.

K may be split so that small-N layers fill the SMs: fp32 partial sums per split, added in a fixed
order by the split that finishes last (one launch, no second kernel). Nothing synchronises with
the host: CUDA-graph safe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType

#: Types this kernel multiplies (each needs its quant planes 4-byte aligned: see :func:`gemv_supported`).
GEMV_TYPES: frozenset[GGMLQuantizationType] = frozenset({Q.Q8_0, Q.Q4_K, Q.Q6_K})
_Q8_0: tl.constexpr = tl.constexpr(int(Q.Q8_0))
_Q4_K: tl.constexpr = tl.constexpr(int(Q.Q4_K))
_Q6_K: tl.constexpr = tl.constexpr(int(Q.Q6_K))


@dataclass(frozen=True)
class GemvConfig:
    """One launch shape: weight rows per program, 256-value superblocks (8 Q8_0 blocks) per step,
    K splits, warps, pipeline stages."""

    block_n: int = 32
    blocks_per_step: int = 1
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _dp4a(w, x, SIGNED_W: tl.constexpr, EMULATE: tl.constexpr):
    """Per 32-bit lane: the sum of the four byte products of ``w`` (unsigned bytes, or signed with
    ``SIGNED_W``) and ``x`` (signed bytes)."""
    if EMULATE:
        total = tl.zeros_like(w)
        for i in tl.static_range(4):
            wb = (w >> (8 * i)) & 255
            if SIGNED_W:
                wb = (wb ^ 128) - 128
            total += wb * ((((x >> (8 * i)) & 255) ^ 128) - 128)
        return total
    elif SIGNED_W:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [w, x], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, 0;", "=r,r,r", [w, x], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def _f16(ptr, mask):
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_x(x_ptr, k0, K, GROUPS: tl.constexpr):
    """x[k0 : k0 + 32 GROUPS] as int8 per group of 32: ``(words [8 GROUPS] int32 of four x quants
    each, in K order; scales [GROUPS] fp32; sums of the quants per 32 [GROUPS] and per 16
    [2 GROUPS], int32)``. Values past K are 0."""
    k = k0 + tl.arange(0, 32 * GROUPS)
    x = tl.reshape(tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32), (GROUPS, 32))
    amax = tl.max(tl.abs(x), axis=1)
    inverse = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    scaled = x * inverse[:, None]
    quants = (scaled + tl.where(scaled >= 0, 0.5, -0.5)).to(tl.int32)  # round half away from zero
    shifts = (tl.arange(0, 4) * 8)[None, :]
    words = tl.sum((tl.reshape(quants, (8 * GROUPS, 4)) & 255) << shifts, axis=1)  # disjoint bytes: sum = OR
    sums16 = tl.sum(tl.reshape(quants, (2 * GROUPS, 16)), axis=1)
    return words, amax / 127.0, tl.sum(tl.reshape(sums16, (GROUPS, 2)), axis=1), sums16


@triton.jit
def _step_sums(
    w_ptr,
    n,
    N,
    K,
    T,
    step,
    xw,
    dx,
    sxq32,
    sxq16,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NB: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """One step of the integer GEMV: the ``[BLOCK_N, 8 NB]`` fp32 sums, per group of 32 values of the
    step, of rows ``n`` (``[BLOCK_N]``, live below ``N``) of the planar ``[N, K]`` matrix at ``w_ptr``
    (``T`` blocks) times x's quants of step ``step`` (:func:`_quantize_x`'s ``words, scales, sums``)."""
    G: tl.constexpr = 8 * NB  # groups of 32 values a step
    row_live = (n < N)[:, None]
    words = tl.pointer_type(tl.int32)
    if QTYPE == _Q8_0:
        blocks_per_row = K // 32
        b = step * G + tl.arange(0, G)[None, :]
        live = row_live & (b < blocks_per_row)
        blk = n[:, None] * blocks_per_row + b  # [BN, G]
        qs = (w_ptr + 2 * T).to(words) + blk[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        wq = tl.load(qs, mask=live[:, :, None], other=0)
        sums = tl.sum(_dp4a(wq, tl.reshape(xw, (G, 8))[None, :, :], True, EMULATE), axis=2)
        return sums.to(tl.float32) * _f16(w_ptr + blk * 2, live) * dx[None, :]
    elif QTYPE == _Q4_K:
        # superblock sb, quarter j (u = 4 sb + j): quant word 8 u + m holds elements 64 u + 4 m..
        # in its low nibbles (group 2 u), 64 u + 32 + 4 m.. in its high ones (group 2 u + 1)
        blocks_per_row = K // 256
        sb = step * NB + tl.arange(0, NB)[None, :]
        live = row_live & (sb < blocks_per_row)  # [BN, NB]
        blk = n[:, None] * blocks_per_row + sb
        first = n * blocks_per_row + step * NB  # [BN]: the step's first superblock of each row
        u4 = tl.arange(0, 4 * NB)[None, :, None, None]
        half = tl.arange(0, 2)[None, None, :, None]
        m4 = tl.arange(0, 8)[None, None, None, :]
        live4 = tl.reshape(tl.broadcast_to(live[:, :, None], (BLOCK_N, NB, 4)), (BLOCK_N, 4 * NB))
        qs = (w_ptr + 16 * T).to(words) + first[:, None, None, None] * 32 + u4 * 8 + m4
        wq = tl.load(qs, mask=live4[:, :, None, None], other=0)  # [BN, 4 NB, 1, 8]
        nibbles = (wq >> (half * 4)) & 0x0F0F0F0F  # [BN, 4 NB, 2, 8]
        sums = tl.reshape(
            tl.sum(_dp4a(nibbles, tl.reshape(xw, (4 * NB, 2, 8))[None], False, EMULATE), axis=3), (BLOCK_N, G)
        )
        scales = (w_ptr + 4 * T).to(words) + blk[:, :, None] * 3
        a = tl.load(scales, mask=live[:, :, None], other=0)
        bw = tl.load(scales + 1, mask=live[:, :, None], other=0)
        c = tl.load(scales + 2, mask=live[:, :, None], other=0)
        g = tl.arange(0, 8)[None, None, :]
        shift = (g % 4) * 8
        low = g < 4
        sc = (tl.where(low, a & 0x3F3F3F3F, (c & 0x0F0F0F0F) | ((a >> 2) & 0x30303030)) >> shift) & 255
        mn = (tl.where(low, bw & 0x3F3F3F3F, ((c >> 4) & 0x0F0F0F0F) | ((bw >> 2) & 0x30303030)) >> shift) & 255
        d = _f16(w_ptr + blk[:, :, None] * 2, live[:, :, None])
        dmin = _f16(w_ptr + 2 * T + blk[:, :, None] * 2, live[:, :, None])
        scale = tl.reshape(d * sc.to(tl.float32), (BLOCK_N, G))
        offset = tl.reshape(dmin * mn.to(tl.float32), (BLOCK_N, G))
        return (scale * sums.to(tl.float32) - offset * sxq32.to(tl.float32)[None, :]) * dx[None, :]
    else:
        tl.static_assert(QTYPE == _Q6_K, "_gemv_kernel: Q8_0, Q4_K or Q6_K")
        # superblock sb, half h (u = 2 sb + h): element 128 u + 64 half + 32 a + 4 t (+0..3) has its
        # low nibble in word 16 u + 8 a + t (nibble `half`), its 2 high bits in word 8 u + t (at
        # 2 a + 4 half); its 16-value group is 8 u + 4 half + 2 a + t // 4
        blocks_per_row = K // 256
        sb = step * NB + tl.arange(0, NB)[None, :]
        live = row_live & (sb < blocks_per_row)
        blk = n[:, None] * blocks_per_row + sb
        first = (n * blocks_per_row + step * NB)[:, None, None, None, None]
        u5 = tl.arange(0, 2 * NB)[None, :, None, None, None]
        half = tl.arange(0, 2)[None, None, :, None, None]
        a5 = tl.arange(0, 2)[None, None, None, :, None]
        t5 = tl.arange(0, 8)[None, None, None, None, :]
        live2 = tl.reshape(tl.broadcast_to(live[:, :, None], (BLOCK_N, NB, 2)), (BLOCK_N, 2 * NB))
        live5 = live2[:, :, None, None, None]
        ql = tl.load(w_ptr.to(words) + first * 32 + u5 * 16 + a5 * 8 + t5, mask=live5, other=0)
        qh = tl.load((w_ptr + 128 * T).to(words) + first * 16 + u5 * 8 + t5, mask=live5, other=0)
        quants = ((ql >> (half * 4)) & 0x0F0F0F0F) | (((qh >> (a5 * 2 + half * 4)) & 0x03030303) << 4)
        products = _dp4a(quants, tl.reshape(xw, (2 * NB, 2, 2, 8))[None], False, EMULATE)
        sums = tl.sum(tl.reshape(products, (BLOCK_N, 2 * G, 4)), axis=2)  # [BN, 16 NB]
        g16 = tl.arange(0, 16)[None, None, :]
        sc = tl.load(
            (w_ptr + 192 * T).to(tl.pointer_type(tl.int8)) + blk[:, :, None] * 16 + g16,
            mask=live[:, :, None],
            other=0,
        ).to(tl.float32)
        d = _f16(w_ptr + 208 * T + blk * 2, live)[:, :, None]
        centred = (sums - 32 * sxq16[None, :]).to(tl.float32) * tl.reshape(d * sc, (BLOCK_N, 2 * G))
        return tl.sum(tl.reshape(centred, (BLOCK_N, G, 2)), axis=2) * dx[None, :]  # quants are stored + 32


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    N,
    K,
    T,
    split_k,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NB: tl.constexpr,
    SPLIT: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Program (block of ``BLOCK_N`` rows, split of K out of ``split_k``); each step is ``NB`` x 256
    values of K of every row (``NB`` superblocks, or 8 ``NB`` Q8_0 blocks). ``T``: GGUF blocks in the
    whole matrix (the planes' lengths).

    ``SPLIT``: each split stores its fp32 sums in its row of ``partial`` ``[split_k, N]`` and counts
    itself in ``counter[pid_n]`` (zero at launch); the split that counts last adds the rows in
    order, writes ``out`` and sets the counter back to zero, so one launch does the whole sum."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    STEP_K: tl.constexpr = 256 * NB
    G: tl.constexpr = 8 * NB  # groups of 32 values a step
    steps = tl.cdiv(K, STEP_K)
    per_split = tl.cdiv(steps, split_k)
    step_lo = pid_k * per_split
    step_hi = tl.minimum(step_lo + per_split, steps)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    for step in range(step_lo, step_hi):
        xw, dx, sxq32, sxq16 = _quantize_x(x_ptr, step * STEP_K, K, G)
        acc += _step_sums(w_ptr, n, N, K, T, step, xw, dx, sxq32, sxq16, QTYPE, BLOCK_N, NB, EMULATE)
    total = tl.sum(acc, axis=1)
    n_live = n < N
    if SPLIT:
        tl.store(partial_ptr + pid_k * N + n, total, mask=n_live)
        tl.debug_barrier()  # every thread's partial sums before the release below
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for split in range(0, split_k):  # in order: the same bits on every run
                total += tl.load(partial_ptr + split * N + n, mask=n_live, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + n, total.to(out_ptr.dtype.element_ty), mask=n_live)
            tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(out_ptr + n, total.to(out_ptr.dtype.element_ty), mask=n_live)


def gemv_supported(qtype: GGMLQuantizationType, k: int, total_blocks: int) -> bool:
    """Whether :func:`gguf_gemv` takes this planar matrix: a built type, K a whole number of steps
    for the K-quants (of blocks for Q8_0) and its quant planes 4-byte aligned (Q8_0: an even block count)."""
    if qtype not in GEMV_TYPES:
        return False
    if qtype == Q.Q8_0:
        return k % 32 == 0 and total_blocks % 2 == 0
    return k % 256 == 0


def gemv_config(qtype: GGMLQuantizationType, n: int, k: int, num_sms: int) -> GemvConfig:
    """The static rule (fitted to the H200 sweep of ``benchmarks/gguf_kernels.py``): 64 rows a
    program for Q4_K, 16 for the wider types, 4 superblocks a step (1 for Q8_0 below 16384 rows), K
    split until the programs cover twice the SMs (at most 8 splits, each at least one step)."""
    block_n = 64 if qtype == Q.Q4_K else 16
    nb = 1 if qtype == Q.Q8_0 and n < 16384 else 4
    steps = triton.cdiv(k, 256 * nb)
    split_k = 1
    programs = triton.cdiv(n, block_n)
    while split_k < 8 and programs * split_k < 2 * num_sms and steps // (2 * split_k) >= 1:
        split_k *= 2
    return GemvConfig(block_n=block_n, blocks_per_step=nb, split_k=split_k)


#: Settings measured per GPU model (``benchmarks/gguf_kernels.py --rows 1 --sweep`` prints entries):
#: ``(device name, type name, N, K) -> setting``; other shapes use :func:`gemv_config`'s rule.
GEMV_TUNED: dict[tuple[str, str, int, int], GemvConfig] = {
    ("NVIDIA H200", "Q4_K", 6144, 4096): GemvConfig(block_n=32, blocks_per_step=4, split_k=4),
    ("NVIDIA H200", "Q4_K", 4096, 4096): GemvConfig(block_n=32, blocks_per_step=4, split_k=4),
    ("NVIDIA H200", "Q4_K", 28672, 4096): GemvConfig(block_n=64, blocks_per_step=4, split_k=1),
    ("NVIDIA H200", "Q4_K", 4096, 14336): GemvConfig(block_n=32, blocks_per_step=4, split_k=4),
    ("NVIDIA H200", "Q4_K", 128256, 4096): GemvConfig(block_n=64, blocks_per_step=4, split_k=1),
    ("NVIDIA H200", "Q6_K", 6144, 4096): GemvConfig(block_n=8, blocks_per_step=4, split_k=1),
    ("NVIDIA H200", "Q6_K", 4096, 4096): GemvConfig(block_n=8, blocks_per_step=4, split_k=1),
    ("NVIDIA H200", "Q6_K", 28672, 4096): GemvConfig(block_n=32, blocks_per_step=4, split_k=1),
    ("NVIDIA H200", "Q6_K", 4096, 14336): GemvConfig(block_n=16, blocks_per_step=4, split_k=2, num_warps=8),
    ("NVIDIA H200", "Q6_K", 128256, 4096): GemvConfig(block_n=16, blocks_per_step=4, split_k=1),
    ("NVIDIA H200", "Q8_0", 6144, 4096): GemvConfig(block_n=8, blocks_per_step=4, split_k=1),
    ("NVIDIA H200", "Q8_0", 4096, 4096): GemvConfig(block_n=8, blocks_per_step=2, split_k=4),
    ("NVIDIA H200", "Q8_0", 28672, 4096): GemvConfig(block_n=8, blocks_per_step=4, split_k=1),
    ("NVIDIA H200", "Q8_0", 4096, 14336): GemvConfig(block_n=8, blocks_per_step=2, split_k=4),
    ("NVIDIA H200", "Q8_0", 128256, 4096): GemvConfig(block_n=8, blocks_per_step=4, split_k=1),
}


def gemv_setting(qtype: GGMLQuantizationType, n: int, k: int, device_name: str, num_sms: int) -> GemvConfig:
    """What :func:`gguf_gemv` launches: the measured setting for this GPU model and shape, else the rule's."""
    return GEMV_TUNED.get((device_name, qtype.name, n, k)) or gemv_config(qtype, n, k, num_sms)


#: Counters the split GEMV's programs arrive on, per device: zero between launches (each launch
#: sets back the ones it used), so they are allocated once, outside any CUDA-graph capture.
COUNTERS = 1 << 16
_counters: dict[torch.device, torch.Tensor] = {}


def reserve_counters(device: torch.device) -> torch.Tensor:
    """The device's split counters, allocated (zeroed) on first use; call it before capturing a graph."""
    device = torch.device(device)
    if device not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "fw_gguf: the GEMV's split counters must be reserved before CUDA-graph capture "
                "(fw_gguf.kernels.gemv.reserve_counters)"
            )
        _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def gguf_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    qtype: GGMLQuantizationType,
    n: int,
    k: int,
    total_blocks: int,
    out: torch.Tensor,
    config: GemvConfig,
) -> torch.Tensor:
    """``out[1, n] = x[1, k] @ W^T`` for planar ``weight`` (checked by the caller,
    :func:`fw_gguf.kernels.matmul.gguf_matmul`), in one launch (K splits included)."""
    emulate = os.environ.get("TRITON_INTERPRET") == "1"
    blocks = triton.cdiv(n, config.block_n)
    split = config.split_k > 1
    if blocks > COUNTERS and split:
        raise ValueError(
            f"a split GEMV over {blocks} blocks of rows needs more than the {COUNTERS} counters; use "
            f"split_k=1 or larger blocks"
        )
    counters = reserve_counters(x.device)
    partial = torch.empty(config.split_k, n, dtype=torch.float32, device=x.device) if split else out
    meta = dict(
        QTYPE=int(qtype),
        BLOCK_N=config.block_n,
        NB=config.blocks_per_step,
        SPLIT=split,
        EMULATE=emulate,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    _gemv_kernel[(blocks, config.split_k)](
        x, weight, out, partial, counters, n, k, total_blocks, config.split_k, **meta
    )
    return out


def quantize_x_reference(x: torch.Tensor) -> torch.Tensor:
    """The activations :func:`gguf_gemv` multiplies, in torch: each 32 values of the rows of ``x``
    (fp32, K a multiple of 32) rounded to ``round(x / d) * d``, ``d = max|x| / 127`` (round half away
    from zero; a group of zeros stays zero)."""
    groups = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    scaled = groups * inverse
    quants = torch.trunc(scaled + torch.where(scaled >= 0, 0.5, -0.5))
    return (quants * (amax / 127.0)).reshape(x.shape)
