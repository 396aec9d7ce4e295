"""The deterministic sum of split-K partial sums, shared by the FP8 GEMV paths (W8A8 block, W8A16).

A split-K launch writes split ``s``'s float32 partial sums into slice ``s`` of a fresh
``[SPLIT_K, M, N]`` buffer (``torch.empty``: every element is written, so nothing is zeroed); then
:func:`sum_splits` adds the slices in a fixed order (0, 1, ...) and rounds once into the output: no
atomics and no memset, so the same bits on every run and every tensor-parallel rank, one launch,
no host sync (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Outputs per program of the sum.
SUM_BLOCK = 1024


@triton.jit
def sum_splits_kernel(partial_ptr, out_ptr, N, stride_ps, stride_pm, stride_om, splits, BLOCK: tl.constexpr):
    """``out[m, n] = sum_s partial[s, m, n]`` in split order; program (row, block of N). ``splits`` is
    a launch argument: one compiled variant per output dtype serves every split count."""
    row, pid = tl.program_id(0), tl.program_id(1)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.load(partial_ptr + row * stride_pm + cols, mask=mask, other=0.0)
    for split in range(1, splits):
        acc += tl.load(partial_ptr + split * stride_ps + row * stride_pm + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out [M, N] = partial [S, M, N].sum(0)`` (float32 partials, rows of unit stride), splits added
    in order, rounded once to ``out``'s dtype. Returns ``out``."""
    splits, m, n = partial.shape
    assert partial.stride(2) == 1 and out.stride(1) == 1 and out.shape == (m, n), (partial.shape, out.shape)
    if m and n:
        block = min(SUM_BLOCK, triton.next_power_of_2(n))
        sum_splits_kernel[(m, triton.cdiv(n, block))](
            partial, out, n, partial.stride(0), partial.stride(1), out.stride(0), splits, BLOCK=block
        )
    return out
