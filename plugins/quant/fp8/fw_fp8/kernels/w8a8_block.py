"""The W8A8 Triton GEMM: activations quantized to FP8 per token and group of ``GROUP`` (128) inputs, then
``tl.dot`` on FP8 operands (tensor cores from sm_89) with both scales applied per K block.

::

    quantize_activations:  x [M, K] -> q float8_e4m3fn [M, K], s float32 [M, ceil(K / GROUP)]
                           s[m, g] = max |x[m, g*GROUP:(g+1)*GROUP]| / 448,   q = x / s
    w8a8_block_matmul:     grid (N / BLOCK_N, M / BLOCK_M, SPLIT_K), BLOCK_K = GROUP
                           (few rows, few N blocks: each program quantizes its own x tiles, FUSED_QUANT)
        for each group kb of the program's 1/SPLIT_K of K:
            acc += tl.dot(q tile, W tile.T) * s[m, kb] * scale[n // SCALE_ROWS, kb * GROUP // SCALE_COLS]

The weight is :mod:`fw_fp8.kernels.layout`'s (block scales, or one column for channel / tensor
weights). A few rows are padded to ``BLOCK_M = 16`` (the smallest FP8 ``tl.dot``); one row reads the
same weight bytes as 16. At small N (o, down, qkv of an 8B model: 64-96 blocks of outputs on 132
SMs) too few programs stream the weights, so K is split (:func:`choose_config`): each split stores
float32 partial sums that :func:`fw_fp8.kernels.splits.sum_splits` adds in a fixed order
(deterministic, no atomics). No host syncs: graph-capturable.

On sm_90 the 16-row decode tiles lower to ``mma.sync`` m16n8k16 on f16 operands, the FP8 bytes
upcast in registers (exact; compute is not what bounds a GEMV); the weight tiles still arrive by
16-byte ``cp.async`` copies (``tests/test_fp8_gemv.py`` compiles every dispatched variant).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..quantize import FP8_DTYPE, FP8_MAX
from .layout import Fp8Weight
from .splits import sum_splits
from .w8a8_tuned import TUNED_W8A8, row_bucket

#: Inputs per activation scale (DeepSeek's 1x128 groups); the GEMM's BLOCK_K.
GROUP = 128
#: The smallest group maximum (an all-zero group).
MIN_AMAX = 1e-10
#: Streaming multiprocessors assumed where the device cannot be asked (the interpreter): an H200's.
DEFAULT_NUM_SMS = 132
#: Up to this many rows the GEMV tiles (16 rows, 64 outputs, 4 stages).
GEMV_MAX_ROWS = 16
#: Split K into at most this many parts, each of at least ``MIN_SPLIT_GROUPS`` groups of 128 inputs,
#: for at most ``SPLIT_MAX_ROWS`` rows.
MAX_SPLIT_K = 8
MIN_SPLIT_GROUPS = 2
SPLIT_MAX_ROWS = 64
#: Quantize inside the GEMM only where at most this many blocks of N repeat each group's quantization.
MAX_FUSED_QUANT_BLOCKS = 32
#: ``SCALE_COLS`` of a one-column scale (channel / tensor weights): above any K, so every group reads
#: column 0, and one compiled variant serves every K.
ONE_SCALE_COLUMN = 1 << 30


@triton.jit
def quantize_activations_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, num_groups, GROUP: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr
):
    row, group = tl.program_id(0), tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX) / FP8_MAX
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * num_groups + group, scale)


def quantize_activations(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, K] float8_e4m3fn, s [M, ceil(K / group)] float32)`` with ``x ~= q * s`` per group.

    On the CPU this is the torch reference: the Triton interpreter's float-to-FP8 conversion
    mis-rounds values that round up into the next binade (0.49 -> 0.25), GPUs convert correctly."""
    if x.device.type == "cpu":
        return quantize_activations_reference(x, group)
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        quantize_activations_kernel[(m, groups)](
            x, q, s, k, x.stride(0), groups, GROUP=group, FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX
        )
    return q, s


def quantize_activations_reference(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`quantize_activations`."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    tiles = padded.view(m, groups, group)
    s = tiles.abs().amax(-1).clamp_min(MIN_AMAX) / FP8_MAX
    q = (tiles / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, -1)[:, :k]
    return q.contiguous(), s


#: Launch arguments that vary with the split and the shape but not the code: not specialized (Triton
#: would compile again whenever one turns a multiple of 16), so a split setting compiles once.
UNSPECIALIZED = ("num_groups", "groups_per_split")


@triton.jit(do_not_specialize=UNSPECIALIZED)
def w8a8_block_matmul_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_om,
    stride_os,
    stride_sn,
    num_groups,
    groups_per_split,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FUSED_QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
):
    """``a_ptr`` holds the FP8 activations and ``a_scale_ptr`` their group scales, or with ``FUSED_QUANT``
    the 16-bit (or fp32) activations themselves (``a_scale_ptr`` unread), quantized per row and group
    here exactly as :func:`quantize_activations_kernel` does."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    scale_row = scale_ptr + (offs_n // SCALE_ROWS) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb_begin = pid_k * groups_per_split  # the launcher sizes the splits so that none is empty
    for kb in range(kb_begin, tl.minimum(kb_begin + groups_per_split, num_groups)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask_a = mask_m[:, None] & mask_k[None, :]
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=mask_a, other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if FUSED_QUANT:  # padding rows and inputs load as 0 and quantize to 0
            a = a.to(tl.float32)
            a_scale = tl.maximum(tl.max(tl.abs(a), axis=1), MIN_AMAX) / FP8_MAX
            a = tl.clamp(a / a_scale[:, None], -FP8_MAX, FP8_MAX).to(w.dtype)
        else:
            a_scale = tl.load(a_scale_ptr + offs_m * num_groups + kb, mask=mask_m, other=0.0)
        w_scale = tl.load(scale_row + (kb * BLOCK_K) // SCALE_COLS, mask=mask_n, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * a_scale[:, None] * w_scale[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def choose_config(rows: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS, device_name: str = "") -> dict[str, int]:
    """Tiles, split-K, warps and stages for ``rows`` x ``[n, k]``: the setting measured for this GPU,
    row bucket and shape (:data:`fw_fp8.kernels.w8a8_tuned.TUNED_W8A8`, up to 64 rows), else a rule
    shaped by what the sweeps measured (``benchmarks/fp8_kernels.py --sweep`` times it beside its
    candidates):

    * tiles: up to 16 rows 16 x 64 with 4 stages (the GEMV), up to 32 rows 32 x 64, up to 64 rows
      64 x 128, more rows 128 x 128 (8 warps); 3 stages above 16 rows;
    * split-K: doubled (up to :data:`MAX_SPLIT_K`) while the tiles fill under two programs per SM,
      each split keeps at least :data:`MIN_SPLIT_GROUPS` groups of 128 inputs, and the float32
      partial sums (written and read once) stay under an eighth of the weight bytes; only up to
      :data:`SPLIT_MAX_ROWS` rows;
    * ``FUSED_QUANT`` (each program quantizes its own activation tiles, the arithmetic of
      :func:`quantize_activations`, saving the quantizer's launch) up to 16 rows and only where at
      most :data:`MAX_FUSED_QUANT_BLOCKS` blocks of N repeat each group's quantization: on more (the
      H200's qkv, gate_up, head) the repeated quantization in the weight loop cost more than the
      launch it saves.
    """
    bucket = row_bucket(rows)
    tuned = TUNED_W8A8.get(device_name, {}).get((bucket, n, k)) if bucket is not None else None
    if tuned is not None:
        return dict(tuned)
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    block_n = 128 if block_m >= 64 else 64
    programs, groups, split_k = triton.cdiv(n, block_n) * triton.cdiv(rows, block_m), triton.cdiv(k, GROUP), 1
    while (
        rows <= SPLIT_MAX_ROWS
        and programs * split_k < 2 * num_sms
        and split_k < MAX_SPLIT_K
        and groups // (split_k * 2) >= MIN_SPLIT_GROUPS
        and 2 * (split_k * 2) * rows * 4 * 8 <= k  # partial bytes 2 * S * rows * n * 4 <= n * k / 8
    ):
        split_k *= 2
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "SPLIT_K": split_k,
        "FUSED_QUANT": rows <= GEMV_MAX_ROWS and triton.cdiv(n, block_n) <= MAX_FUSED_QUANT_BLOCKS,
        "num_warps": 8 if block_m >= 128 else 4,
        "num_stages": 4 if rows <= GEMV_MAX_ROWS else 3,
    }


def split_groups(groups: int, split_k: int) -> tuple[int, int]:
    """``(groups per split, splits)`` launched for ``split_k`` asked over ``groups`` groups of K: whole
    groups per split, and no empty split (so 5 groups asked in 4 run as 3 splits of 2, 2, 1)."""
    per_split = triton.cdiv(groups, max(1, split_k))
    return per_split, triton.cdiv(groups, per_split)


def w8a8_block_matmul(x: torch.Tensor, weight: Fp8Weight, config: dict | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in ``x.dtype``, ``x`` quantized per token and group of 128 inputs.
    ``config`` (keys of :func:`choose_config`; ``SPLIT_K`` defaults to 1, ``FUSED_QUANT`` to up to 16
    rows) overrides the choice; a ``SPLIT_K`` above the groups of K is lowered so that no split is empty.

    Under the Triton interpreter a fused quantization rounds as the interpreted quantizer kernel does
    (some values into the wrong binade, see :func:`quantize_activations`); the unfused path uses the
    torch quantizer on the CPU."""
    m, k = x.shape
    n = weight.out_features
    if x.stride(-1) != 1:
        x = x.contiguous()
    scale_cols = weight.scale_cols if weight.scale.shape[1] > 1 else ONE_SCALE_COLUMN
    assert scale_cols % GROUP == 0, scale_cols
    cfg = dict(config or choose_config(m, n, k, _num_sms(x.device), _device_name(x.device)))
    num_warps, num_stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
    fused = bool(cfg.pop("FUSED_QUANT", m <= GEMV_MAX_ROWS))
    # fused: the kernel reads x itself (the scale pointer is unread)
    (q, s), stride_am = ((x, x), x.stride(0)) if fused else (quantize_activations(x), k)
    groups = triton.cdiv(k, GROUP)
    groups_per_split, split_k = split_groups(groups, cfg.pop("SPLIT_K", 1))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split_k)
    w8a8_block_matmul_kernel[grid](
        q,
        s,
        weight.qweight,
        weight.scale,
        partial,
        m,
        n,
        k,
        stride_am,
        n,
        m * n,
        weight.scale.stride(0),
        groups,
        groups_per_split,
        SCALE_ROWS=weight.scale_rows,
        SCALE_COLS=scale_cols,
        BLOCK_K=GROUP,
        FUSED_QUANT=fused,
        FP8_MAX=FP8_MAX,
        MIN_AMAX=MIN_AMAX,
        num_warps=num_warps,
        num_stages=num_stages,
        **cfg,
    )
    return out if split_k == 1 else sum_splits(partial, out)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
