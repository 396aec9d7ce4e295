"""Decode-sized linear layers: ``x @ weight.T + bias`` for a few rows, as a split-K Triton GEMV.

A batch-1 decode step is bound by its weight reads, and cuBLAS does not stream one row at the
copy bandwidth at every layer shape; this kernel does better at the shapes of the table in
:mod:`fw_triton_ops.gemv_tuned` (``benchmarks/gemv_bandwidth.py`` measures both; the results are
in docs/benchmarks.md). One row goes through ``tl.dot`` (padded to 16 rows) at most shapes, as its
loads pipeline better than the elementwise product's.

:func:`linear` is the kernel registry's ``linear`` op (:func:`framework.ops.linear`), the default
on CUDA. It runs the GEMV only where it was measured faster, and calls ``F.linear`` itself for
everything else:

* CUDA tensors of bf16 or fp16 on a GPU model with measured settings (the H200; fp32 and other
  GPUs go to cuBLAS; under ``TRITON_INTERPRET=1`` CPU tensors of fp32 run interpreted, for the
  tests, as the interpreter computes bf16 wrongly);
* ``x`` of any shape ``[..., K]`` holding one row (batch-1 decode; more rows go to cuBLAS: only one
  row was measured from HBM), and a weight shape that the device's table does not give to cuBLAS;
* ``weight`` ``[N, K]`` with unit column stride, ``bias`` (optional) ``[N]`` contiguous, all of
  ``x``'s dtype and device, no autograd.

Launches per call (each one a node in a captured decode graph):

* one, ``split_k == 1``: the kernel adds the bias and stores the rounded result;
* two, ``split_k > 1``: split ``s`` of the K dimension stores its float32 partial sums into slice
  ``s`` of a fresh ``[split_k, rows, N]`` buffer (``torch.empty``: every element is written, so
  nothing is zeroed), then :func:`_sum_splits_kernel` adds the slices in a fixed order, adds the
  bias and rounds: no atomics and no memset, so the same bits on every run and every
  tensor-parallel rank. The partial sums are ``16 * split_k * rows * N`` bytes, a fraction of a
  percent of the weight bytes at decode shapes.

Configuration: settings measured per GPU model and shape (:func:`linear_config`), a static rule
(:func:`gemv_config`) fitted to the sweep for other shapes on such a GPU, not ``triton.autotune``.
Autotuning times every candidate (synchronising) on the first call of each shape; the engine's
eager warm-up before each CUDA-graph capture would absorb that, but a shape first met inside a
capture would break it, the choice would differ between runs and ranks, and it cannot be used
under the interpreter. A table and a rule cost nothing per call, never synchronise, and give the
same setting on every run and rank of one GPU model; the benchmark times the rule next to the best
of its sweep (the table is that best), so a poor fit shows.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from fw_triton_ops.gemv_tuned import TUNED_ONE_ROW, GemvConfig

#: Streaming multiprocessors assumed off CUDA (the interpreter): the H200's, where the rule was fitted.
DEFAULT_NUM_SMS = 132
#: Triton reads this once, when a kernel is decorated; so does :func:`linear`.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_GPU_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
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
            w = tl.load(
                w_ptr + cols[:, None] * stride_wn + ks[None, :],
                mask=(cols[:, None] < N) & (ks[None, :] < k_hi),
                other=0.0,
            ).to(tl.float32)
            tiles += w * x[None, :]
        acc = tl.sum(tiles, axis=1)[None, :]
    else:
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :],
                mask=(rows[:, None] < M) & (ks[None, :] < k_hi),
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols[:, None] * stride_wn + ks[None, :],
                mask=(cols[:, None] < N) & (ks[None, :] < k_hi),
                other=0.0,
            )
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
def _sum_splits_kernel(
    partial_ptr,
    bias_ptr,
    out_ptr,
    N,
    stride_ps,
    stride_pm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
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


def gemv_config(n: int, k: int, rows: int, num_sms: int = DEFAULT_NUM_SMS) -> GemvConfig:
    """The rule's setting for ``[rows, k] @ [n, k]^T`` (bf16), for shapes without a measured one
    (:mod:`fw_triton_ops.gemv_tuned`):

    * one row, fitted to the H200 sweep with the weights read from HBM (the layer shapes of
      Llama-3-8B, Llama-3-70B, Qwen3-32B, Qwen3-0.6B at TP 1 and 2): rows padded to 16 through
      ``tl.dot``, 4 warps, ``BLOCK_K=256``, ``BLOCK_N`` 128 from N = 8192, 64 from 5120, else 32,
      and K split in two when the N blocks fill under half the SMs and K >= 2048
      (``benchmarks/gemv_bandwidth.py`` times the rule beside the sweep's best);
    * 2-8 rows, fitted to a sweep whose weights stayed in L2 (:func:`linear` sends only one row
      here): no split, 4 warps, ``BLOCK_K=256``, ``BLOCK_N=128`` from N = 16384, else 64.
    """
    if rows == 1:
        block_n = 128 if n >= 8192 else 64 if n >= 5120 else 32
        split_k = 2 if triton.cdiv(n, block_n) < num_sms // 2 and k >= 2048 else 1
        return GemvConfig(block_n=block_n, block_k=256, split_k=split_k, num_warps=4, tensor_cores=True)
    return GemvConfig(block_n=128 if n >= 16384 else 64, block_k=256, split_k=1, num_warps=4)


def linear_config(n: int, k: int, device: torch.device) -> GemvConfig | None:
    """What :func:`linear` runs for one row against an ``[n, k]`` weight on ``device``: the setting
    measured for this GPU and shape (:mod:`fw_triton_ops.gemv_tuned`; None where cuBLAS was as
    fast), else :func:`gemv_config`'s rule."""
    table = TUNED_ONE_ROW.get(_device_name(device), {})
    if (n, k) in table:
        return table[(n, k)]
    return gemv_config(n, k, 1, _num_sms(device))


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None, config: GemvConfig) -> Tensor:
    """``x @ weight.T + bias`` with ``config``, for a 2-D ``x`` ``[rows, K]`` (unit column stride) and
    ``weight`` ``[N, K]`` (unit column stride); ``bias`` ``[N]`` contiguous or None; a few rows (the
    benchmark times 1 and 8; more than 16 pad ``tl.dot`` further and are not what it is for). Returns a new
    ``[rows, N]`` tensor of ``x.dtype``. No checks beyond these: :func:`linear` decides what comes here."""
    rows, k = x.shape
    n = weight.shape[0]
    m_pad = 1 if rows == 1 and not config.tensor_cores else max(16, triton.next_power_of_2(rows))
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else out  # never read without HAS_BIAS
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    if config.split_k == 1:
        _gemv_kernel[grid](
            x,
            weight,
            bias_arg,
            out,
            rows,
            n,
            k,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            0,
            HAS_BIAS=bias is not None,
            M_PAD=m_pad,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            SPLIT_K=1,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        return out
    partial = torch.empty(config.split_k, rows, n, dtype=torch.float32, device=x.device)
    _gemv_kernel[grid](
        x,
        weight,
        bias_arg,
        partial,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        partial.stride(1),
        partial.stride(0),
        HAS_BIAS=False,
        M_PAD=m_pad,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=config.split_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    block = min(1024, triton.next_power_of_2(n))
    _sum_splits_kernel[(rows, triton.cdiv(n, block))](
        partial,
        bias_arg,
        out,
        n,
        partial.stride(0),
        partial.stride(1),
        out.stride(0),
        HAS_BIAS=bias is not None,
        SPLIT_K=config.split_k,
        BLOCK=block,
        num_warps=4,
    )
    return out


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@functools.cache
def _measured_gpu(device: torch.device) -> bool:
    """Whether this GPU model has a table of measured settings (:mod:`fw_triton_ops.gemv_tuned`):
    the GEMV runs only there; other GPUs keep cuBLAS until the benchmark has measured them."""
    return _device_name(device) in TUNED_ONE_ROW


def takes(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether :func:`linear` runs the GEMV for these arguments (else it calls ``F.linear``)."""
    if x.device.type == "cuda" and _measured_gpu(x.device):
        dtypes = _GPU_DTYPES
    elif x.device.type == "cpu" and INTERPRETED:
        dtypes = (torch.float32,)
    else:
        return False
    k = x.shape[-1] if x.dim() else 0
    return (
        x.dtype in dtypes
        and weight.dtype == x.dtype
        and weight.device == x.device
        and weight.dim() == 2
        and weight.shape[1] == k > 0
        and weight.shape[0] > 0
        and weight.stride(1) == 1
        and weight.shape[0] * weight.stride(0) < 2**31  # the kernel's offsets are 32-bit
        and x.numel() == k  # one row
        and (
            bias is None
            or (
                bias.dtype == x.dtype
                and bias.device == x.device
                and bias.dim() == 1
                and bias.shape[0] == weight.shape[0]
                and bias.stride(0) == 1
            )
        )
        and not (
            torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        )
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The ``linear`` op (:func:`framework.ops.linear`): the GEMV for one row on a GPU with measured
    settings (see the module docstring for which), ``F.linear`` for the rest. Returns ``[..., N]`` of ``x.dtype``."""
    if not takes(x, weight, bias):
        return F.linear(x, weight, bias)
    n, k = weight.shape
    config = linear_config(n, k, x.device)
    if config is None:
        return F.linear(x, weight, bias)
    x2d = x.reshape(1, k)
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    return gemv(x2d, weight, bias, config).view(*x.shape[:-1], n)
