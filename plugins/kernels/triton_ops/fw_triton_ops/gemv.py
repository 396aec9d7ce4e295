"""Decode-sized linear layers: ``x @ weight.T + bias`` for a few rows, as a split-K Triton GEMV.

A batch-1 decode step is its weight reads. On an H200 (copy bandwidth 4.28 TB/s), cuBLAS streams
Llama-3-8B's QKV, O and down projections at TP=2 at 2.7-2.9 TB/s; at one row the sweep's best
setting of this kernel streamed them at 2.9-3.3 TB/s, and took Llama-3-8B TP=2's weights
(fastest of the two per layer) from 2.24 to 2.16 ms, Qwen3-32B TP=2's from 8.61 to 8.45 ms
(``benchmarks/gemv_bandwidth.py``: ``docs/benchmarks/2026-11-30-h200x2-gemv-bandwidth-50bfb9c.json``,
measured with an atomic-add split K that this module replaced; see below). Not yet timed inside
a model.

:func:`linear` is the kernel registry's ``linear`` op (:func:`framework.ops.linear`). It runs the
GEMV only where it is meant to be good, and calls ``F.linear`` itself for everything else:

* CUDA tensors of bf16 or fp16 (fp32 goes to cuBLAS; under ``TRITON_INTERPRET=1`` CPU tensors
  of fp32 run interpreted, for the tests, as the interpreter computes bf16 wrongly);
* ``x`` of any shape ``[..., K]`` whose leading dimensions hold 1 to :data:`MAX_ROWS` rows;
* ``weight`` ``[N, K]`` with unit column stride, ``bias`` (optional) ``[N]`` contiguous, all of
  ``x``'s dtype and device, no autograd.

Launches per call (each one a node in a captured decode graph):

* one, ``split_k == 1``: the kernel adds the bias and stores the rounded result;
* two, ``split_k > 1``: split ``s`` of the K dimension stores its float32 partial sums into slice
  ``s`` of a fresh ``[split_k, rows, N]`` buffer (``torch.empty``: every element is written, so
  nothing is zeroed), then :func:`_sum_splits_kernel` adds the slices in a fixed order, adds the
  bias and rounds. The atomic-add version that the sweep timed took three (a memset of the float32
  output, the GEMV, a cast) and summed in a different order every run; this one takes two and
  gives the same bits on every run and every tensor-parallel rank. The partial sums are
  ``16 * split_k * rows * N`` bytes, a fraction of a percent of the weight bytes at decode shapes.

Configuration: a static rule (:func:`gemv_config`), fitted to the sweep, not ``triton.autotune``.
Autotuning times every candidate (synchronising) on the first call of each shape; the engine's
eager warm-up before each CUDA-graph capture would absorb that, but a shape first met inside a
capture would break it, the choice would differ between runs and ranks, and it cannot be used
under the interpreter. A rule costs nothing per call, never synchronises, and is the same
everywhere; the benchmark times its choice next to the best of its sweep, so a poor fit shows.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

#: The most rows (tokens) the GEMV takes; more go to ``F.linear`` (cuBLAS's GEMMs are good there).
MAX_ROWS = 8
#: Streaming multiprocessors assumed off CUDA (the interpreter): the H200's, where the rule was fitted.
DEFAULT_NUM_SMS = 132
#: Triton reads this once, when a kernel is decorated; so does :func:`linear`.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_GPU_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_os,
                 HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr):
    """``out[M, N] = x[M, K] @ w[N, K]^T (+ bias)``; program (block of N, split of K)::

        w  [N, K]   columns k_lo..k_hi of split pid_k      out (SPLIT_K == 1): rounded, bias added
           +---------+---------+---------+---------+        out (SPLIT_K > 1): [SPLIT_K, M, N] float32,
           | pid_k=0 |    1    |    2    |    3    |  <- BLOCK_N rows of pid_n     slice pid_k
           +---------+---------+---------+---------+

    One row (``M_PAD == 1``): multiply-accumulate ``[BLOCK_N, BLOCK_K]`` tiles elementwise and
    reduce once at the end. More rows: pad them to ``M_PAD >= 16`` and use ``tl.dot`` (tensor cores).
    """
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)  # a trailing split may be empty: it stores zeros
    rows = tl.arange(0, M_PAD)
    if M_PAD == 1:
        tiles = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + ks, mask=ks < k_hi, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < k_hi),
                        other=0.0).to(tl.float32)
            tiles += w * x[None, :]
        acc = tl.sum(tiles, axis=1)[None, :]
    else:
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < k_hi),
                        other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < k_hi),
                        other=0.0)
            acc += tl.dot(x, tl.trans(w))
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None] * stride_om + cols[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + pid_k * stride_os + offsets, acc, mask=mask)


@triton.jit
def _sum_splits_kernel(partial_ptr, bias_ptr, out_ptr, N, stride_ps, stride_pm, stride_om,
                       HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """``out[m, n] = sum_s partial[s, m, n] (+ bias[n])``, splits added in order; program (row, block of N)."""
    row, pid = tl.program_id(0), tl.program_id(1)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.load(partial_ptr + row * stride_pm + cols, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLIT_K):
        acc += tl.load(partial_ptr + split * stride_ps + row * stride_pm + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


class GemvConfig(NamedTuple):
    """One launch setting of :func:`gemv` (the benchmark sweeps these)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int = 4


def gemv_config(n: int, k: int, rows: int, num_sms: int = DEFAULT_NUM_SMS) -> GemvConfig:
    """The setting for ``[rows, k] @ [n, k]^T``, fitted to the H200 sweep (bf16, 1 and 8 rows, the
    Llama-3-8B and Qwen3-32B layers at TP 1 and 2):

    * one row: ``BLOCK_N=32, BLOCK_K=128``, 8 warps won at 17 of 20 shapes. Split K in four when the
      N blocks fill under two waves of the SMs and K >= 4096 (QKV, O and down at TP 2: 96-192
      blocks); above that (gate/up, LM head) one split already fills the GPU. This picks the
      sweep's split at 18 of 20 shapes (the two misses: shapes where cuBLAS was faster anyway);
    * 2-8 rows (``tl.dot`` over rows padded to 16): no split, 4 warps, ``BLOCK_K=256``,
      ``BLOCK_N=128`` from N = 16384 (gate/up, LM head), else 64: the sweep's winner at 7 of the 13
      shapes where the GEMV beat cuBLAS at 8 rows, one block size off it at the other 6 (the
      benchmark's ``rule`` column shows what that costs). The sweep split K at 8 rows only where
      cuBLAS was faster anyway.
    """
    if rows == 1:
        wide = triton.cdiv(n, 32) >= 2 * num_sms
        return GemvConfig(block_n=32, block_k=128, split_k=1 if wide or k < 4096 else 4, num_warps=8)
    return GemvConfig(block_n=128 if n >= 16384 else 64, block_k=256, split_k=1, num_warps=4)


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None, config: GemvConfig) -> Tensor:
    """``x @ weight.T + bias`` with ``config``, for a 2-D ``x`` ``[rows, K]`` (unit column stride) and
    ``weight`` ``[N, K]`` (unit column stride); ``bias`` ``[N]`` contiguous or None. Returns a new
    ``[rows, N]`` tensor of ``x.dtype``. No checks beyond these: :func:`linear` decides what comes here."""
    rows, k = x.shape
    n = weight.shape[0]
    m_pad = 1 if rows == 1 else max(16, triton.next_power_of_2(rows))
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else out  # never read without HAS_BIAS
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    if config.split_k == 1:
        _gemv_kernel[grid](x, weight, bias_arg, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0), 0,
                           HAS_BIAS=bias is not None, M_PAD=m_pad, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                           SPLIT_K=1, num_warps=config.num_warps, num_stages=config.num_stages)
        return out
    partial = torch.empty(config.split_k, rows, n, dtype=torch.float32, device=x.device)
    _gemv_kernel[grid](x, weight, bias_arg, partial, rows, n, k, x.stride(0), weight.stride(0), partial.stride(1),
                       partial.stride(0), HAS_BIAS=False, M_PAD=m_pad, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                       SPLIT_K=config.split_k, num_warps=config.num_warps, num_stages=config.num_stages)
    block = min(1024, triton.next_power_of_2(n))
    _sum_splits_kernel[(rows, triton.cdiv(n, block))](partial, bias_arg, out, n, partial.stride(0), partial.stride(1),
                                                      out.stride(0), HAS_BIAS=bias is not None,
                                                      SPLIT_K=config.split_k, BLOCK=block, num_warps=4)
    return out


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def takes(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether :func:`linear` runs the GEMV for these arguments (else it calls ``F.linear``)."""
    if x.device.type == "cuda":
        dtypes = _GPU_DTYPES
    elif x.device.type == "cpu" and INTERPRETED:
        dtypes = (torch.float32,)
    else:
        return False
    k = x.shape[-1] if x.dim() else 0
    return (x.dtype in dtypes and weight.dtype == x.dtype and weight.device == x.device and weight.dim() == 2
            and weight.shape[1] == k > 0 and weight.shape[0] > 0 and weight.stride(1) == 1
            and weight.shape[0] * weight.stride(0) < 2**31  # the kernel's offsets are 32-bit
            and 1 <= x.numel() // k <= MAX_ROWS
            and (bias is None or (bias.dtype == x.dtype and bias.device == x.device and bias.dim() == 1
                                  and bias.shape[0] == weight.shape[0] and bias.stride(0) == 1))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad))))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The ``linear`` op (:func:`framework.ops.linear`): the GEMV for decode-sized inputs (see the
    module docstring for which), ``F.linear`` for the rest. Returns ``[..., N]`` of ``x.dtype``."""
    if not takes(x, weight, bias):
        return F.linear(x, weight, bias)
    n, k = weight.shape
    x2d = x.reshape(-1, k)
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    out = gemv(x2d, weight, bias, gemv_config(n, k, x2d.shape[0], _num_sms(x.device)))
    return out.view(*x.shape[:-1], n)
