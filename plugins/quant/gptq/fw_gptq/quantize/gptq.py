"""GPTQ (Frantar et al., 2022): quantize a weight column by column, spreading each column's rounding
error over the columns not yet quantized through the inverse Hessian of the layer's inputs."""

from __future__ import annotations

import torch
from torch import Tensor

from ..packing import IntWeight
from .rtn import group_params, quantize_values

BLOCK = 128  # columns updated together (the lazy batch update of the paper)


def gptq_quantize(
    w: Tensor, hessian: Tensor, bits: int, group_size: int, symmetric: bool, act_order: bool = False, damp: float = 0.01
) -> IntWeight:
    """GPTQ of ``w [N, K]`` given ``hessian = sum x x^T [K, K]`` of its calibration inputs.

    With ``act_order`` the columns are quantized in order of decreasing Hessian diagonal; the groups
    are then consecutive in that order (``g_idx[perm[j]] = j // group_size``, GPTQ's desc_act).
    """
    n, k = w.shape
    group = k if group_size == -1 else group_size
    w = w.float().clone()
    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k)
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    scales = torch.zeros(-(-k // group), n)  # the last group may be shorter
    zeros = torch.zeros(-(-k // group), n)
    for start in range(0, k, BLOCK):
        end = min(start + BLOCK, k)
        block, errors, h_block = w[:, start:end].clone(), torch.zeros(n, end - start), h_inv[start:end, start:end]
        for i in range(end - start):
            column = start + i
            if column % group == 0:  # this group's parameters from the columns as updated so far
                current = torch.cat([block[:, i:], w[:, end:]], dim=1)[:, :group]
                scales[column // group], zeros[column // group] = group_params(current, bits, symmetric)
            scale, zero = scales[column // group], zeros[column // group]
            q[:, column] = quantize_values(block[:, i], scale, zero, bits)
            error = (block[:, i] - (q[:, column] - zero) * scale) / h_block[i, i]
            block[:, i:] -= error[:, None] * h_block[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ h_inv[start:end, end:]
    unpermuted = torch.empty_like(q)
    unpermuted[:, perm] = q
    g_idx = None
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // group
    return IntWeight(
        unpermuted.t().to(torch.uint8).contiguous(),
        scales,
        None if symmetric else zeros.to(torch.uint8),
        g_idx,
        bits,
        group,
    )
