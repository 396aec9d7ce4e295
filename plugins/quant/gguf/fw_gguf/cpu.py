"""GGUF weight matrices kept packed on the CPU: the file's blocks, multiplied by ``cpu_kernels.cpp``.

A layer's shards (``gguf_weight_<i>``, rows of GGUF blocks exactly as in the file) stay as they
are: RAM for the weights is the file's size. :func:`linear_cpu` computes ``x @ W^T (+ bias)`` in
fp32 for any batch::

    rows <= DIRECT_MAX_ROWS:  one kernel call per shard, decoding each block as it is read and
                              multiplying it with up to 8 rows of x (decode: memory-bound)
    more rows (prefill):      the shard dequantized CHUNK_ELEMENTS at a time by the same decoder
                              into a scratch matrix, multiplied by torch's BLAS (compute-bound)

Dequantized values equal gguf-py's bit for bit (``fw_gguf.dequant``); only the order of the fp32
sums differs from ``F.linear`` on the dequantized matrix. :func:`cpu_packable` says whether a
layer can stay packed (every shard of a :data:`CPU_TYPES` type and the kernels built).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from .cpu_build import load_kernels

#: GGUF types the CPU kernels decode (others are dequantized at load).
CPU_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})
#: Up to this many rows of x multiply the packed blocks directly; more dequantize chunks for BLAS.
DIRECT_MAX_ROWS = 16
#: fp32 values per dequantized scratch chunk in the many-rows path (16 MB).
CHUNK_ELEMENTS = 1 << 22


def kernels_available() -> bool:
    return load_kernels() is not None


def cpu_packable(types: list[Q]) -> bool:
    """Whether shards of these types can stay packed on this CPU."""
    return all(qtype in CPU_TYPES for qtype in types) and kernels_available()


def _check(code: int, qtype: Q) -> None:
    if code:
        raise ValueError(
            f"the GGUF CPU kernels do not decode {qtype.name}; they decode "
            f"{', '.join(sorted(t.name for t in CPU_TYPES))}"
        )


def matmul_cpu(x2d: torch.Tensor, packed: torch.Tensor, qtype: Q, rows: int, out: torch.Tensor) -> None:
    """``out = x2d @ W^T`` for one shard: ``x2d`` fp32 contiguous ``[M, K]``, ``packed`` uint8 GGUF
    rows ``[rows, bytes]``, ``out`` an fp32 ``[M, rows]`` view whose rows may be a wider tensor's
    (unit column stride)."""
    lib, (m, k) = load_kernels(), x2d.shape
    if m <= DIRECT_MAX_ROWS:
        _check(
            lib.fw_gguf_matmul(
                int(qtype),
                x2d.data_ptr(),
                packed.data_ptr(),
                rows,
                k,
                m,
                out.data_ptr(),
                out.stride(0),
                torch.get_num_threads(),
            ),
            qtype,
        )
        return
    step = max(1, CHUNK_ELEMENTS // k)
    scratch = torch.empty(min(step, rows), k, dtype=torch.float32)
    for first in range(0, rows, step):
        count = min(step, rows - first)
        weight = scratch[:count]
        _check(
            lib.fw_gguf_dequantize(
                int(qtype), packed[first].data_ptr(), count, k, weight.data_ptr(), torch.get_num_threads()
            ),
            qtype,
        )
        out[:, first : first + count] = x2d @ weight.t()


def dequantize_cpu(packed: torch.Tensor, qtype: Q, rows: int, k: int) -> torch.Tensor:
    """The shard's fp32 ``[rows, k]`` values (bit-exact with ``fw_gguf.dequant.dequantize``)."""
    out = torch.empty(rows, k, dtype=torch.float32)
    _check(
        load_kernels().fw_gguf_dequantize(
            int(qtype), packed.data_ptr(), rows, k, out.data_ptr(), torch.get_num_threads()
        ),
        qtype,
    )
    return out


def linear_cpu(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` over the layer's packed shards into one ``[..., N]`` output of x's dtype
    (computed in fp32: other dtypes are converted in and out). Decode-sized calls go straight to
    the kernel, one call per shard, with the shard list read once per layer (:func:`shard_plan`)."""
    k = layer.gguf_in_features
    x2d = x.reshape(-1, k)
    if x2d.dtype != torch.float32 or not x2d.is_contiguous():
        x2d = x2d.to(torch.float32).contiguous()
    plan, n = shard_plan(layer)
    m = x2d.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if 0 < m <= DIRECT_MAX_ROWS:
        lib, threads, x_ptr, out_ptr = load_kernels(), torch.get_num_threads(), x2d.data_ptr(), out.data_ptr()
        for qtype, packed, rows, start in plan:
            _check(
                lib.fw_gguf_matmul(qtype, x_ptr, packed.data_ptr(), rows, k, m, out_ptr + 4 * start, n, threads),
                Q(qtype),
            )
    elif m:
        for qtype, packed, rows, start in plan:
            matmul_cpu(x2d, packed, Q(qtype), rows, out[:, start : start + rows])
    if bias is not None:
        out += bias
    out = out.view(*x.shape[:-1], n)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def shard_plan(layer: nn.Module) -> tuple[list[tuple[int, torch.Tensor, int, int]], int]:
    """``([(type id, packed rows, rows, first output column)], output width)`` of the layer's
    shards, built on first use and kept on the layer."""
    plan = layer.__dict__.get("_gguf_cpu_plan")
    if plan is None:
        plan, start = [], 0
        for index, (qtype, rows) in enumerate(zip(layer.gguf_types, layer.gguf_rows)):
            plan.append((int(qtype), getattr(layer, f"gguf_weight_{index}"), rows, start))
            start += rows
        plan = layer.__dict__["_gguf_cpu_plan"] = (plan, start)
    return plan
