"""GGUF weights multiplied and dequantized where they lie packed: Triton kernels over :func:`decode`.

* :func:`gguf_matmul`: ``out[M, N] = x[M, K] @ W[N, K]^T`` with ``W`` packed. One row of a planar
  Q8_0 / Q4_K / Q6_K matrix (the decode step of most files) goes to the integer GEMV of
  :mod:`fw_gguf.kernels.gemv` (x rounded to int8 per 32 values, as llama.cpp does), 2..``MMQ_MAX_ROWS``
  rows of one to the int8 tensor-core MMQ of :mod:`fw_gguf.kernels.mmq` (x rounded the same way;
  ``FW_GGUF_MMQ=0`` turns it off); everything else to one kernel, two forms by the constexpr ``BLOCK_M``:

  - ``BLOCK_M == 1`` (one row of the other types, or asked for with a ``GGUFKernelConfig``: exact
    in x): each program streams ``BLOCK_N`` weight rows over
    its split of K once, multiplies elementwise in fp32 and reduces at the end. x is read by the
    threads of every weight row (the tile's layout, from L1/L2: no layout conversion), or, with
    ``SHARED_X`` (:attr:`GGUFKernelConfig.shared_x`, off by default), once per program and handed
    to the rows through shared memory;
  - ``BLOCK_M >= 16`` (2-8 rows padded to 16, and batches/prefill): the decoded tile is cast to x's
    dtype and multiplied on the tensor cores (``tl.dot``, fp32 accumulation).

  Both forms decode with :func:`decode_weights`: one FMA per weight (plus the offset's subtraction
  for the affine types), the fp32 values of the reference, then one cast to x's dtype. The cast
  stays in fp32 -> bf16/fp16 rather than scaling in 16 bits: bf16 cannot hold an fp16 scale, and
  Triton runs 16-bit arithmetic one value per instruction, no cheaper than fp32.

  K may be split (``split_k``) to give small-N layers enough programs: split ``s`` stores fp32 partial
  sums into slice ``s`` of a ``[split_k, M, N]`` buffer (every element written, nothing zeroed) and
  :func:`_sum_splits_kernel` adds the slices in a fixed order: the same bits on every run, no atomics.
* :func:`gguf_dequantize`: packed -> ``[N, K]`` matrix, each value ``q * scale - offset`` with fp
  contraction off, so bit-exact with the fp32 torch reference (:mod:`fw_gguf.dequant`) before the
  final cast.

The planar weights' quant bytes are read in 16-byte loads (``ld.global.v4.b32``, or 16-byte
``cp.async`` for the tensor-core tiles) when the compiler knows their alignment: Triton's launcher
specializes on a 16-byte-aligned weight pointer and ``T`` (blocks in all) divisible by 16, as every
model shape has; else the loads narrow to what the alignment it can prove allows.

Nothing here synchronises or copies from the host, so every call can be captured in a CUDA graph.
Configurations are static per shape, not autotuned: a table measured per GPU model (:data:`TUNED`,
filled from ``benchmarks/gguf_kernels.py --sweep``), else a rule (:func:`matmul_config`); the same
choice on every run and rank, nothing timed or synchronised at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from fw_gguf.kernels.decode import GROUPS, decode, decode_weights
from fw_gguf.kernels.gemv import GEMV_TYPES, GemvConfig, gemv_setting, gemv_supported, gguf_gemv
from fw_gguf.kernels.mmq import MMQ_TUNED, MMQ_TYPES, MmqConfig, gguf_mmq, mmq_config, mmq_supported, mmq_takes

#: Streaming multiprocessors assumed where the device cannot be asked (the interpreter): an H200's.
DEFAULT_NUM_SMS = 132


@dataclass(frozen=True)
class GGUFKernelConfig:
    """One launch shape of :func:`gguf_matmul`: rows per program (1: elementwise GEMV, >= 16:
    ``tl.dot``), weight rows per program, GGUF blocks per K step, K splits, warps and stages; and
    for the GEMV, ``shared_x``: read x once per program and share it across the ``block_n`` rows
    through shared memory, instead of each row's threads reading it (the rule leaves it off; the
    sweep times both, :data:`TUNED` may turn it on). Raises ``ValueError`` for ``shared_x`` with
    ``block_m != 1``."""

    block_m: int
    block_n: int
    blocks_per_step: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    shared_x: bool = False

    def __post_init__(self) -> None:
        if self.shared_x and self.block_m != 1:
            raise ValueError(f"shared_x is a form of the 1-row GEMV (block_m=1), not of block_m={self.block_m}")


@triton.jit
def _matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    T,
    stride_xm,
    stride_om,
    stride_os,
    QTYPE: tl.constexpr,
    PLANAR: tl.constexpr,
    G: tl.constexpr,
    S: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NB: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SHARED_X: tl.constexpr,
):
    """Program (block of N, split of K, block of M); each K step is ``NB`` GGUF blocks of every row.
    ``SHARED_X`` (``BLOCK_M == 1`` only): x loaded as ``[1, NB, G, S]`` and broadcast over the rows."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    QK: tl.constexpr = G * S
    BLOCK_K: tl.constexpr = NB * QK
    blocks_per_row = K // QK
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n4 = n[:, None, None, None]
    b4 = tl.arange(0, NB)[None, :, None, None]
    g4 = tl.arange(0, G)[None, None, :, None]
    s4 = tl.arange(0, S)[None, None, None, :]
    per_split = tl.cdiv(tl.cdiv(blocks_per_row, SPLIT_K), NB) * NB
    kb_lo = pid_k * per_split
    kb_hi = tl.minimum(kb_lo + per_split, blocks_per_row)  # a trailing split may be empty: it stores zeros
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if BLOCK_M == 1:
        tiles = tl.zeros((BLOCK_N, NB, G, S), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb0 in range(kb_lo, kb_hi, NB):
        kb = kb0 + b4
        live = kb < kb_hi
        w = decode_weights(w_ptr, n4 * blocks_per_row + kb, T, g4, s4, (n4 < N) & live, QTYPE, PLANAR)
        if BLOCK_M == 1:
            # per row: x in the weight tile's own layout; shared: 1/BLOCK_N of the loads, plus a conversion
            if SHARED_X:
                x = tl.load(x_ptr + kb * QK + g4 * S + s4, mask=live, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_ptr + n4 * 0 + kb * QK + g4 * S + s4, mask=live, other=0.0).to(tl.float32)
            tiles += w * x
        else:
            ks = kb0 * QK + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :],
                mask=(rows[:, None] < M) & (ks[None, :] < kb_hi * QK),
                other=0.0,
            )
            # rounded to x's dtype in the decoding layout, so a layout change moves 16-bit values
            acc += tl.dot(x, tl.trans(tl.reshape(w.to(x.dtype), (BLOCK_N, BLOCK_K))))
    if BLOCK_M == 1:
        acc = tl.sum(tl.sum(tl.sum(tiles, axis=3), axis=2), axis=1)[None, :]
    mask = (rows[:, None] < M) & (n[None, :] < N)
    offsets = rows[:, None] * stride_om + n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + pid_k * stride_os + offsets, acc, mask=mask)


@triton.jit
def _sum_splits_kernel(
    partial_ptr, out_ptr, N, stride_ps, stride_pm, stride_om, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr
):
    """``out[m, n] = sum_s partial[s, m, n]``, splits added in order; program (row, block of N)."""
    row, pid = tl.program_id(0), tl.program_id(1)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.load(partial_ptr + row * stride_pm + cols, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLIT_K):
        acc += tl.load(partial_ptr + split * stride_ps + row * stride_pm + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(
    w_ptr,
    out_ptr,
    N,
    K,
    T,
    stride_on,
    QTYPE: tl.constexpr,
    PLANAR: tl.constexpr,
    G: tl.constexpr,
    S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NB: tl.constexpr,
):
    """Program (block of rows, ``NB`` blocks of K): ``out[n, k] = q * scale - offset`` (launched unfused)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    QK: tl.constexpr = G * S
    blocks_per_row = K // QK
    n4 = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[:, None, None, None]
    kb = pid_k * NB + tl.arange(0, NB)[None, :, None, None]
    g4 = tl.arange(0, G)[None, None, :, None]
    s4 = tl.arange(0, S)[None, None, None, :]
    mask = (n4 < N) & (kb < blocks_per_row)
    q, scale, offset = decode(w_ptr, n4 * blocks_per_row + kb, T, g4, s4, mask, QTYPE, PLANAR)
    values = q * scale - offset
    tl.store(out_ptr + n4 * stride_on + kb * QK + g4 * S + s4, values.to(out_ptr.dtype.element_ty), mask=mask)


def matmul_config(
    qtype: GGMLQuantizationType, n: int, k: int, rows: int, num_sms: int = DEFAULT_NUM_SMS
) -> GGUFKernelConfig:
    """The static rule: what :func:`gguf_matmul` launches for ``[rows, k] @ [n, k]^T`` of ``qtype``.

    * 1 row: elementwise GEMV, 32 weight rows and 256 values of K per step, K split until the
      programs cover twice the SMs (at most 8 splits, each at least 4 steps);
    * 2-8 rows: the same streaming shape on tensor cores (rows padded to 16);
    * more: tensor-core tiles, ``BLOCK_M`` the rows rounded up to 16..64, 256 values of K per step
      (one K-quant block), K split until the programs cover the SMs (at most 4 splits, each at
      least 4 steps); ``BLOCK_N`` 64 on 4 warps up to 16 rows, else 32 on 8 warps: the tiles that
      ptxas compiles for sm_90 without spilling registers (a ``BLOCK_N`` x 256 decoded fp32 tile
      and the accumulator share a thread's 255; 64 x 64 on 4 warps spills ~0.5 KB a thread for
      Q4_K / Q6_K / Q8_0, 64 x 128 on 8 warps ~0.3 KB).
    """
    block_size = GROUPS[qtype][0] * GROUPS[qtype][1]
    per_step = max(1, 256 // block_size)
    steps = k // block_size // per_step
    if rows <= 8:
        block_n = 32
        split_k = 1
        programs = triton.cdiv(n, block_n)
        while split_k < 8 and programs * split_k < 2 * num_sms and steps // (2 * split_k) >= 4:
            split_k *= 2
        return GGUFKernelConfig(
            block_m=1 if rows == 1 else 16,
            block_n=block_n,
            blocks_per_step=per_step,
            split_k=split_k,
            num_warps=4,
            num_stages=3,
        )
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = 64 if rows <= 16 else 32
    split_k = 1
    programs = triton.cdiv(n, block_n) * triton.cdiv(rows, block_m)
    while split_k < 4 and programs * split_k < num_sms and steps // (2 * split_k) >= 4:
        split_k *= 2
    return GGUFKernelConfig(
        block_m=block_m,
        block_n=block_n,
        blocks_per_step=per_step,
        split_k=split_k,
        num_warps=4 if rows <= 16 else 8,
        num_stages=2,
    )


#: Settings measured on a GPU model (``benchmarks/gguf_kernels.py --sweep`` prints entries to paste):
#: ``(device name, type name, N, K, row bucket) -> setting``, where the row bucket is
#: :func:`row_bucket`'s. Shapes not listed use :func:`matmul_config`'s rule.
TUNED: dict[tuple[str, str, int, int, int], GGUFKernelConfig] = {}


def row_bucket(rows: int) -> int:
    """The rows a tuned setting is measured at and used for: 1, up to 8, up to 64, more (512)."""
    return 1 if rows == 1 else 8 if rows <= 8 else 64 if rows <= 64 else 512


def kernel_config(qtype: GGMLQuantizationType, n: int, k: int, rows: int, device: torch.device) -> GGUFKernelConfig:
    """What :func:`gguf_matmul` launches on ``device``: the measured setting (:data:`TUNED`) if any,
    else the rule's."""
    if TUNED:
        tuned = TUNED.get((_device_name(device), qtype.name, n, k, row_bucket(rows)))
        if tuned is not None:
            return tuned
    return matmul_config(qtype, n, k, rows, _num_sms(device))


def mmq_setting(qtype: GGMLQuantizationType, n: int, k: int, rows: int, device: torch.device) -> MmqConfig:
    """What :func:`gguf_matmul` launches for the MMQ on ``device``: :data:`fw_gguf.kernels.mmq.MMQ_TUNED`'s
    setting for the shape and :func:`row_bucket`, else :func:`fw_gguf.kernels.mmq.mmq_config`'s rule."""
    if MMQ_TUNED:
        tuned = MMQ_TUNED.get((_device_name(device), qtype.name, n, k, row_bucket(rows)))
        if tuned is not None:
            return tuned
    return mmq_config(qtype, n, k, rows, _num_sms(device))


def _check(weight: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int) -> tuple[int, int]:
    if qtype not in GROUPS:
        raise ValueError(f"no GGUF kernel for {qtype.name}; kernels exist for {', '.join(t.name for t in GROUPS)}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if k % block_size:
        raise ValueError(f"{qtype.name}: K={k} is not a whole number of {block_size}-value blocks")
    total_blocks = n * (k // block_size)
    if weight.dtype != torch.uint8 or weight.numel() != total_blocks * type_size:
        raise ValueError(
            f"{qtype.name} [{n}, {k}] needs {total_blocks * type_size} packed bytes (uint8), got "
            f"{weight.numel()} {weight.dtype}"
        )
    if weight.numel() >= 2**31 or n * k >= 2**31:
        raise ValueError(
            f"{qtype.name} [{n}, {k}]: the kernels' offsets are 32-bit; {weight.numel()} bytes and "
            f"{n * k} values must each stay below 2**31"
        )
    return total_blocks, block_size


def gguf_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    qtype: GGMLQuantizationType,
    n: int,
    k: int,
    *,
    planar: bool = False,
    out: torch.Tensor | None = None,
    config: GGUFKernelConfig | GemvConfig | MmqConfig | None = None,
) -> torch.Tensor:
    """``x @ W^T`` for a 2-D ``x`` ``[rows, k]`` (unit column stride) and ``W`` ``[n, k]`` packed as
    ``qtype`` (contiguous uint8, GGUF or planar layout). Writes into ``out`` (``[rows, n]`` of x's
    dtype, unit column stride: a column slice of a fused layer's output works) or a new tensor,
    and returns it. Raises ``ValueError`` for a type without a kernel or a byte count that does not
    match ``[n, k]``, and for a ``GemvConfig`` / ``MmqConfig`` the integer kernels cannot take.

    A config chooses the kernel; without one, 1 row of a planar Q8_0 / Q4_K / Q6_K matrix runs the
    integer GEMV, 2..``MMQ_MAX_ROWS`` rows of one the int8 tensor-core MMQ (:mod:`fw_gguf.kernels.mmq`,
    while ``MMQ_ENABLED``), the rest the tile kernel."""
    total_blocks, _ = _check(weight, qtype, n, k)
    rows = x.shape[0]
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if isinstance(config, MmqConfig) or (config is None and mmq_takes(qtype, rows, k, total_blocks, planar)):
        if not planar or not mmq_supported(qtype, k, total_blocks):
            raise ValueError(
                f"the int8 MMQ multiplies a planar {', '.join(sorted(t.name for t in MMQ_TYPES))} matrix; got a "
                f"{'planar' if planar else 'GGUF-layout'} {qtype.name} [{n}, {k}]"
            )
        return gguf_mmq(x, weight, qtype, n, k, total_blocks, out, config or mmq_setting(qtype, n, k, rows, x.device))
    if isinstance(config, GemvConfig) or (
        rows == 1 and planar and config is None and gemv_supported(qtype, k, total_blocks)
    ):
        if rows != 1 or not planar or not gemv_supported(qtype, k, total_blocks):
            raise ValueError(
                f"the integer GEMV multiplies one row of x by a planar {', '.join(sorted(t.name for t in GEMV_TYPES))} "
                f"matrix; got {rows} rows of a {'planar' if planar else 'GGUF-layout'} {qtype.name} [{n}, {k}]"
            )
        return gguf_gemv(
            x,
            weight,
            qtype,
            n,
            k,
            total_blocks,
            out,
            config or gemv_setting(qtype, n, k, _device_name(x.device), _num_sms(x.device)),
        )
    config = config or kernel_config(qtype, n, k, rows, x.device)
    if config.block_m == 1 and rows > 1:  # the elementwise form reads one row of x
        raise ValueError(f"GGUFKernelConfig(block_m=1) multiplies one row of x; got {rows} rows (use block_m >= 16)")
    groups, size = GROUPS[qtype]
    grid = (triton.cdiv(n, config.block_n), config.split_k, triton.cdiv(rows, config.block_m))
    meta = dict(
        QTYPE=int(qtype),
        PLANAR=planar,
        G=groups,
        S=size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        NB=config.blocks_per_step,
        SPLIT_K=config.split_k,
        SHARED_X=config.shared_x,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if config.split_k == 1:
        _matmul_kernel[grid](x, weight, out, rows, n, k, total_blocks, x.stride(0), out.stride(0), 0, **meta)
        return out
    partial = torch.empty(config.split_k, rows, n, dtype=torch.float32, device=x.device)
    _matmul_kernel[grid](
        x, weight, partial, rows, n, k, total_blocks, x.stride(0), partial.stride(1), partial.stride(0), **meta
    )
    return _sum_splits(partial, out)


def _sum_splits(partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = partial.sum(0)`` (``partial`` ``[splits, rows, n]`` fp32, contiguous), splits added in order."""
    splits, rows, n = partial.shape
    block = min(1024, triton.next_power_of_2(n))
    _sum_splits_kernel[(rows, triton.cdiv(n, block))](
        partial, out, n, partial.stride(0), partial.stride(1), out.stride(0), SPLIT_K=splits, BLOCK=block, num_warps=4
    )
    return out


def gguf_dequantize(
    weight: torch.Tensor,
    qtype: GGMLQuantizationType,
    n: int,
    k: int,
    dtype: torch.dtype,
    *,
    planar: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``W`` ``[n, k]`` packed as ``qtype`` -> values in ``dtype`` (into ``out``, ``[n, k]`` with unit
    column stride, when given), computed in fp32 bit-exactly as :func:`fw_gguf.dequant.dequantize`
    and then cast. Same errors as :func:`gguf_matmul`."""
    total_blocks, block_size = _check(weight, qtype, n, k)
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=weight.device)
    groups, size = GROUPS[qtype]
    per_step = max(1, 256 // block_size)
    block_n = 16
    grid = (triton.cdiv(n, block_n), triton.cdiv(k // block_size, per_step))
    _dequantize_kernel[grid](
        weight,
        out,
        n,
        k,
        total_blocks,
        out.stride(0),
        QTYPE=int(qtype),
        PLANAR=planar,
        G=groups,
        S=size,
        BLOCK_N=block_n,
        NB=per_step,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


_SMS: dict[int, int] = {}
_NAMES: dict[torch.device, str] = {}


def _device_name(device: torch.device) -> str:
    if device not in _NAMES:
        _NAMES[device] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return _NAMES[device]


def _cuda_sms(index: int) -> int:
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]
