"""The one weight layout the W4A16 / W8A16 kernel reads, built at load from any format.

::

    qweight  int32 [N, K/pf]   input k of output n in word k // pf of row n, bits (k % pf) * bits   (pf = 32 // bits)
    scales   [G, N]            in the activations' dtype
    zeros    [G, N] or None    zero points as values of that dtype; None: all 2 ** (bits - 1)
    g_idx    int32 [K] or None group of each (permuted) input feature; None: k // group_size
    perm     int64 [K] or None act-order: input k of the kernel is input perm[k] of the layer

Each output feature's weights are one contiguous run over K (the planar layout of ``fw_gguf``'s
quants, and compressed-tensors' ``weight_packed``): the one-row GEMV (:mod:`~fw_gptq.kernels.gemv_int8`)
streams a long run of each of its rows and sums a row's 32-input groups inside a thread; the tile
kernel loads ``[BLOCK_N, SUB_K / pf]`` words a slice, runs of ``SUB_K / pf`` words. Scales and zeros
stay ``[G, N]``: a block of outputs reads a contiguous run of each group. Act-order weights are permuted at load so that their
groups are contiguous (``perm = argsort(g_idx)``); the activations are permuted in ``apply``. When
the sorted groups are the plain ``k // group_size`` (always for one rank of a GPTQ checkpoint) the
kernel reads each group's scales once per block; otherwise it looks every row's group up.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..packing import IntWeight, pack_along, unpack_along


class KernelWeight(NamedTuple):
    qweight: Tensor
    scales: Tensor
    zeros: Tensor | None
    g_idx: Tensor | None
    perm: Tensor | None
    bits: int
    group_size: int  # input features per group (K for channel-wise)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (32 // self.bits)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]


def to_kernel_layout(weight: IntWeight, dtype: torch.dtype) -> KernelWeight:
    """Repack ``weight`` for the kernel, scales and zeros in ``dtype``."""
    q, g_idx, perm = weight.q, weight.g_idx, None
    k = q.shape[0]
    natural = torch.arange(k, device=q.device) // weight.group_size
    if g_idx is not None:
        if torch.equal(g_idx, natural):
            g_idx = None
        else:
            perm = torch.argsort(g_idx, stable=True)
            q, g_idx = q.index_select(0, perm), g_idx.index_select(0, perm)
            g_idx = None if torch.equal(g_idx, natural) else g_idx.to(torch.int32)
    zeros = weight.zeros
    if zeros is not None and bool((zeros == 2 ** (weight.bits - 1)).all()):
        zeros = None
    return KernelWeight(
        pack_along(q.t(), weight.bits, 1),
        weight.scales.to(dtype).contiguous(),
        None if zeros is None else zeros.to(dtype).contiguous(),
        g_idx.contiguous() if g_idx is not None else None,
        perm,
        weight.bits,
        weight.group_size,
    )


def dequantize_kernel_weight(weight: KernelWeight, dtype: torch.dtype, *, permuted: bool = False) -> Tensor:
    """``W`` ``[N, K]`` in ``dtype`` from the kernel layout: the torch reference of the kernel. With
    ``permuted`` the columns stay in the kernel's (act-order) input order."""
    q = unpack_along(weight.qweight, weight.bits, 1).t()  # [K, N]
    groups = (
        weight.g_idx.long()
        if weight.g_idx is not None
        else (torch.arange(q.shape[0], device=q.device) // weight.group_size)
    )
    zeros = weight.zeros.float() if weight.zeros is not None else float(2 ** (weight.bits - 1))
    scales = weight.scales.float()
    w = (q.float() - (zeros[groups] if isinstance(zeros, Tensor) else zeros)) * scales[groups]  # [K, N]
    if weight.perm is not None and not permuted:
        w = torch.empty_like(w).index_copy_(0, weight.perm, w)
    return w.t().to(dtype)
