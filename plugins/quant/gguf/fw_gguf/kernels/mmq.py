"""GGUF batches and prefill on int8 tensor cores, as llama.cpp's MMQ: ``out[M, N] = x[M, K] @ W[N, K]^T``.

The tile kernel of :mod:`fw_gguf.kernels.matmul` decodes every weight to fp32 and casts it to
bf16 for ``tl.dot``: its instruction count, not memory, bounds a batch. This path does what the
integer GEMV (:mod:`fw_gguf.kernels.gemv`) does per row, for a tile of rows on the tensor cores:

1. :func:`quantize_rows` rounds x once per call to int8 with one fp32 scale per 32 values
   (``d = max|x| / 127``, round half away from zero: :func:`fw_gguf.kernels.gemv.quantize_x_reference`),
   and stores each 32 values' quant sum (Q4_K's offset term needs it);
2. :func:`_mmq_kernel` unpacks each 32 values of a weight tile to int8 with masks and shifts
   (Q8_0 as stored, Q4_K nibbles 0..15, Q6_K six bits minus 32) and per 32-value group of K takes
   ``tl.dot(x_q [BLOCK_M, 32], w_q [32, BLOCK_N]) -> int32``, then::

       acc[m, n] += d_x[m, g] * (scale[n, g] * dot[m, n]  -  offset[n, g] * sum_{k in g} x_q[m, k])

   Q6_K's 16-value groups take two dots per 32 (x masked to each half), combined in int32 with
   their int8 scales before the conversion.

So the result is that of the exact dequantized weights times x rounded to 8 bits per 32 values,
as the GEMV's. Built for planar Q8_0, Q4_K and Q6_K (:data:`MMQ_TYPES`; the types of Q4_K_M and
Q8_0 files); other types keep the tile kernel. K may be split: fp32 partials per split, summed in
order by :func:`fw_gguf.kernels.matmul._sum_splits` (deterministic, no atomics). Nothing
synchronises with the host: CUDA-graph safe.

Dispatch (:func:`mmq_takes`): :func:`fw_gguf.kernels.matmul.gguf_matmul` sends 2..:data:`MMQ_MAX_ROWS`
rows of a supported planar matrix here while :data:`MMQ_ENABLED`; ``FW_GGUF_MMQ=0`` / ``=1`` and
``FW_GGUF_MMQ_MAX_ROWS`` override both at import (for timing one path against the other).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType

MMQ_TYPES: frozenset[GGMLQuantizationType] = frozenset({Q.Q8_0, Q.Q4_K, Q.Q6_K})
#: Whether :func:`fw_gguf.kernels.matmul.gguf_matmul` runs 2..MMQ_MAX_ROWS rows here (else the tile kernel).
MMQ_ENABLED: bool = os.environ.get("FW_GGUF_MMQ", "1") != "0"
#: Up to this many rows the MMQ serves by default: on the H200 (9cab9cc, ``benchmarks/gguf_kernels.py --rows 16
#: 64 512``) it beat the tile kernel at 16 rows on every Llama-3-8B layer of Q4_K, Q6_K and Q8_0 (Q4_K gate_up
#: 86.8 against 115.6 us, Q8_0 77.9 against 150.9) and lost at 64 (Q4_K gate_up 237.0 against 153.1) and at
#: 512 rows to dequantize + cuBLAS (1553.9 against 244.2): its per-group scaling after every 32-deep int8 dot
#: serialises the tensor cores once the tiles are 64 rows high.
MMQ_MAX_ROWS: int = int(os.environ.get("FW_GGUF_MMQ_MAX_ROWS", "16"))
_Q8_0: tl.constexpr = tl.constexpr(int(Q.Q8_0))
_Q4_K: tl.constexpr = tl.constexpr(int(Q.Q4_K))
_Q6_K: tl.constexpr = tl.constexpr(int(Q.Q6_K))


@dataclass(frozen=True)
class MmqConfig:
    """One launch shape of :func:`gguf_mmq`: rows and weight rows per program (each >= 16), K splits,
    warps and pipeline stages."""

    block_m: int = 64
    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.block_m < 16 or self.block_n < 16:
            raise ValueError(f"MmqConfig tiles are at least 16 x 16 (tl.dot), got {self.block_m} x {self.block_n}")


def mmq_supported(qtype: GGMLQuantizationType, k: int, total_blocks: int) -> bool:
    """Whether :func:`gguf_mmq` multiplies this planar matrix: a built type and K whole steps of the
    kernel's (256-value superblocks; 32-value blocks for Q8_0). Any block count ``T``: the word-wide
    loads (Q4_K / Q6_K scales) are 4-byte aligned for every ``T``."""
    return qtype in MMQ_TYPES and k % (32 if qtype == Q.Q8_0 else 256) == 0


def mmq_takes(qtype: GGMLQuantizationType, rows: int, k: int, total_blocks: int, planar: bool) -> bool:
    """The default dispatch: whether ``rows`` rows of this matrix go to :func:`gguf_mmq`."""
    return MMQ_ENABLED and planar and 2 <= rows <= MMQ_MAX_ROWS and mmq_supported(qtype, k, total_blocks)


def mmq_config(qtype: GGMLQuantizationType, n: int, k: int, rows: int, num_sms: int) -> MmqConfig:
    """The static rule: ``BLOCK_M`` the rows rounded up to 16..64, ``BLOCK_N`` 64, K split until the
    programs cover the SMs (at most 4 splits, each at least 4 superblocks of K)."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = 64
    steps = k // 256
    programs = triton.cdiv(n, block_n) * triton.cdiv(rows, block_m)
    split_k = 1
    while split_k < 4 and programs * split_k < num_sms and steps // (2 * split_k) >= 4:
        split_k *= 2
    return MmqConfig(block_m=block_m, block_n=block_n, split_k=split_k, num_warps=4, num_stages=2)


#: Settings measured per GPU model (``benchmarks/gguf_kernels.py --sweep`` prints entries):
#: ``(device name, type name, N, K, row bucket) -> setting``; other shapes use :func:`mmq_config`.
MMQ_TUNED: dict[tuple[str, str, int, int, int], MmqConfig] = {}


@triton.jit
def _quantize_rows_kernel(x_ptr, xq_ptr, dx_ptr, sx_ptr, K, stride_xm, BLOCK_G: tl.constexpr):
    """Program (row, ``BLOCK_G`` groups of 32): ``xq[row, k]`` int8, ``dx[row, g]`` fp32 scale,
    ``sx[row, g]`` int32 sum of the group's quants. K is a multiple of 32."""
    row, pid = tl.program_id(0), tl.program_id(1)
    groups = K // 32
    g = pid * BLOCK_G + tl.arange(0, BLOCK_G)
    k = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    live = g < groups
    x = tl.load(x_ptr + row * stride_xm + k, mask=live[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    inverse = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    scaled = x * inverse[:, None]
    quants = (scaled + tl.where(scaled >= 0, 0.5, -0.5)).to(tl.int32)  # round half away from zero
    tl.store(xq_ptr + row * K + k, quants.to(tl.int8), mask=live[:, None])
    tl.store(dx_ptr + row * groups + g, amax / 127.0, mask=live)
    tl.store(sx_ptr + row * groups + g, tl.sum(quants, axis=1), mask=live)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (unit column stride, K a multiple of 32) -> ``(xq int8 [M, K], dx fp32 [M, K/32],
    sx int32 [M, K/32])``: ``xq * dx`` is :func:`fw_gguf.kernels.gemv.quantize_x_reference` of x."""
    rows, k = x.shape
    xq = torch.empty(rows, k, dtype=torch.int8, device=x.device)
    dx = torch.empty(rows, k // 32, dtype=torch.float32, device=x.device)
    sx = torch.empty(rows, k // 32, dtype=torch.int32, device=x.device)
    block_g = 32
    _quantize_rows_kernel[(rows, triton.cdiv(k // 32, block_g))](x, xq, dx, sx, k, x.stride(0), BLOCK_G=block_g)
    return xq, dx, sx


@triton.jit
def _int_to_float(value):
    """int32 ``|value| < 2**22`` as the equal fp32, in two full-rate operations (see ``decode``)."""
    return (value + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _f16(ptr, mask):
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _mmq_kernel(
    xq_ptr,
    dx_ptr,
    sx_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    T,
    stride_om,
    stride_os,
    QTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Program (block of N, block of M, split of K); each step one 256-value superblock of every
    weight row (8 Q8_0 blocks). ``T``: GGUF blocks in the matrix (the planes' lengths)."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_live, n_live = rows < M, n < N
    s = tl.arange(0, 32)
    groups = K // 32  # of x (its scales' row length)
    steps = tl.cdiv(K, 256)
    per_split = tl.cdiv(steps, SPLIT_K)
    step_lo = pid_k * per_split
    step_hi = tl.minimum(step_lo + per_split, steps)  # a trailing split may be empty: it stores zeros
    x_rows = xq_ptr + rows[:, None] * K + s[None, :]  # [BM, 32] pointers at k = 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(step_lo, step_hi):
        if QTYPE == _Q8_0:
            for j in tl.static_range(8):
                b = step * 8 + j  # block of K
                m_live = row_live & (rows * 0 + b < groups)  # a Q8_0 K need not be whole superblocks
                w_live = n_live & (n * 0 + b < groups)
                xq = tl.load(x_rows + b * 32, mask=m_live[:, None], other=0)
                dx = tl.load(dx_ptr + rows * groups + b, mask=m_live, other=0.0)
                blk = n * groups + b
                wq = tl.load(w_ptr + 2 * T + blk[:, None] * 32 + s[None, :], mask=w_live[:, None], other=0)
                dot = tl.dot(xq, tl.trans(wq.to(tl.int8, bitcast=True)), out_dtype=tl.int32)
                d = _f16(w_ptr + blk * 2, w_live)
                acc = tl.fma(_int_to_float(dot) * dx[:, None], d[None, :], acc)
        elif QTYPE == _Q4_K:
            blocks_per_row = K // 256
            blk = n * blocks_per_row + step
            d = _f16(w_ptr + blk * 2, n_live)
            dmin = _f16(w_ptr + 2 * T + blk * 2, n_live)
            # the 12 scale bytes as 3 words (4-byte aligned: the plane starts at 4 T, blocks are 12 bytes)
            scales = (w_ptr + 4 * T).to(tl.pointer_type(tl.int32)) + blk * 3
            a = tl.load(scales, mask=n_live, other=0)
            bm = tl.load(scales + 1, mask=n_live, other=0)
            c = tl.load(scales + 2, mask=n_live, other=0)
            qs = w_ptr + 16 * T + blk[:, None] * 128 + s[None, :]
            for pair in tl.static_range(4):
                byte = _u8(qs + pair * 32, n_live[:, None])  # [BN, 32]: groups 2 pair (low), 2 pair + 1 (high)
                for half in tl.static_range(2):
                    g = 2 * pair + half
                    shift = 8 * (g % 4)  # group g's byte of each word
                    if g < 4:
                        sc, mn = (a >> shift) & 63, (bm >> shift) & 63
                    else:
                        sc = ((c >> shift) & 15) | (((a >> shift) >> 2) & 48)
                        mn = ((c >> shift) >> 4 & 15) | (((bm >> shift) >> 2) & 48)
                    wq = ((byte >> (4 * half)) & 15).to(tl.int8)
                    kg = step * 8 + g
                    xq = tl.load(x_rows + kg * 32, mask=row_live[:, None], other=0)
                    dx = tl.load(dx_ptr + rows * groups + kg, mask=row_live, other=0.0)
                    sx = tl.load(sx_ptr + rows * groups + kg, mask=row_live, other=0)
                    dot = tl.dot(xq, tl.trans(wq), out_dtype=tl.int32)
                    acc = tl.fma(_int_to_float(dot) * dx[:, None], (d * _int_to_float(sc))[None, :], acc)
                    acc = tl.fma((-dx * _int_to_float(sx))[:, None], (dmin * _int_to_float(mn))[None, :], acc)
        else:
            tl.static_assert(QTYPE == _Q6_K, "_mmq_kernel: Q8_0, Q4_K or Q6_K")
            # 32-value group j = 4 h + i of the superblock (h its half): low nibbles from ql byte
            # 64 h + 32 (i % 2) + s (nibble i // 2), two high bits from qh byte 32 h + s (bits 2 i);
            # its 16-value scales are sc[2 j] (s < 16) and sc[2 j + 1]
            blocks_per_row = K // 256
            blk = n * blocks_per_row + step
            d = _f16(w_ptr + 208 * T + blk * 2, n_live)
            sc_words = (w_ptr + 192 * T).to(tl.pointer_type(tl.int32)) + blk * 4  # 16 int8 scales as 4 words
            first_half = (s < 16)[None, :]
            for h in tl.static_range(2):
                ql0 = _u8(w_ptr + blk[:, None] * 128 + 64 * h + s[None, :], n_live[:, None])
                ql1 = _u8(w_ptr + blk[:, None] * 128 + 64 * h + 32 + s[None, :], n_live[:, None])
                qh = _u8(w_ptr + 128 * T + blk[:, None] * 64 + 32 * h + s[None, :], n_live[:, None])
                for i in tl.static_range(4):
                    j = 4 * h + i
                    if i % 2 == 0:
                        low = (ql0 >> (4 * (i // 2))) & 15
                    else:
                        low = (ql1 >> (4 * (i // 2))) & 15
                    wq = ((low | (((qh >> (2 * i)) & 3) << 4)) - 32).to(tl.int8)
                    kg = step * 8 + j
                    xq = tl.load(x_rows + kg * 32, mask=row_live[:, None], other=0)
                    dx = tl.load(dx_ptr + rows * groups + kg, mask=row_live, other=0.0)
                    w_t = tl.trans(wq)
                    dot_lo = tl.dot(tl.where(first_half, xq, 0).to(tl.int8), w_t, out_dtype=tl.int32)
                    dot_hi = tl.dot(tl.where(first_half, 0, xq).to(tl.int8), w_t, out_dtype=tl.int32)
                    word = tl.load(
                        sc_words + j // 2, mask=n_live, other=0
                    )  # scales 2 j, 2 j + 1: bytes 2 (j % 2) + 0, 1
                    sc_lo = (word << (24 - 16 * (j % 2))) >> 24  # arithmetic shift: the signed byte
                    sc_hi = (word << (16 - 16 * (j % 2))) >> 24
                    # each half's sum (|.| < 2**16) converted alone, in full-rate operations
                    both = tl.fma(
                        _int_to_float(dot_lo),
                        (d * _int_to_float(sc_lo))[None, :],
                        _int_to_float(dot_hi) * (d * _int_to_float(sc_hi))[None, :],
                    )
                    acc = tl.fma(both, dx[:, None], acc)
    mask = row_live[:, None] & n_live[None, :]
    offsets = rows[:, None] * stride_om + n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + pid_k * stride_os + offsets, acc, mask=mask)


def gguf_mmq(
    x: torch.Tensor,
    weight: torch.Tensor,
    qtype: GGMLQuantizationType,
    n: int,
    k: int,
    total_blocks: int,
    out: torch.Tensor,
    config: MmqConfig,
) -> torch.Tensor:
    """``out[rows, n] = x @ W^T`` for a planar ``weight`` the caller checked
    (:func:`fw_gguf.kernels.matmul.gguf_matmul`; :func:`mmq_supported`), x rounded as :func:`quantize_rows`."""
    from fw_gguf.kernels.matmul import _sum_splits

    rows = x.shape[0]
    xq, dx, sx = quantize_rows(x)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(rows, config.block_m), config.split_k)
    meta = dict(
        QTYPE=int(qtype),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        SPLIT_K=config.split_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if config.split_k == 1:
        _mmq_kernel[grid](xq, dx, sx, weight, out, rows, n, k, total_blocks, out.stride(0), 0, **meta)
        return out
    partial = torch.empty(config.split_k, rows, n, dtype=torch.float32, device=x.device)
    _mmq_kernel[grid](
        xq, dx, sx, weight, partial, rows, n, k, total_blocks, partial.stride(1), partial.stride(0), **meta
    )
    return _sum_splits(partial, out)
