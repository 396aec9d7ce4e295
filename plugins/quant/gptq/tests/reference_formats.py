"""Independent writers of every format, for the tests: the packing formulas of AutoGPTQ / GPTQModel
(GPTQ v1, v2), AutoAWQ (GEMM) and IST-DASLab Marlin re-implemented here with numpy loops (not fw's
packer), and compressed-tensors' own ``pack_to_int32`` from PyPI.

Each ``write_*`` takes integer values ``q [K, N]``, scales ``[G, N]``, zeros ``[G, N]`` (or None)
and returns the checkpoint tensors of one weight; :func:`random_int_weight` draws them with a
trained model's magnitude and the float32 reference ``W [N, K]`` they stand for.
"""

from __future__ import annotations

import numpy as np
import torch

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


def random_int_weight(
    n: int, k: int, bits: int, group_size: int, symmetric: bool, act_order: bool, generator: torch.Generator
):
    """``(q [K, N] int64, scales [G, N], zeros [G, N] or None, g_idx [K], W [N, K] float32)``."""
    group = k if group_size == -1 else group_size
    groups = k // group
    q = torch.randint(0, 2**bits, (k, n), generator=generator)
    scales = (0.002 + 0.01 * torch.rand(groups, n, generator=generator)).half().float()
    zeros = None if symmetric else torch.randint(1, 2**bits, (groups, n), generator=generator)
    if act_order:
        # one order per input size: weights of the same inputs (q/k/v, gate/up) share their Hessian, so
        # GPTQ gives them the same g_idx
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(k))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // group  # GPTQ's: the j-th quantized column belongs to group j // group
    else:
        g_idx = torch.arange(k) // group
    z = torch.full((groups, n), 2 ** (bits - 1)) if zeros is None else zeros
    w = ((q - z[g_idx]).float() * scales[g_idx]).t().contiguous()
    return q, scales, zeros, g_idx, w


def _pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's qweight loop: row ``r`` of the result holds rows ``r * pf + j`` at ``bits * j``."""
    pf = 32 // bits
    values = values.astype(np.uint32)
    out = np.zeros((values.shape[0] // pf, values.shape[1]), dtype=np.uint32)
    for row in range(out.shape[0]):
        for j in range(pf):
            out[row] |= values[row * pf + j] << (bits * j)
    return out.view(np.int32)


def _pack_columns(values: np.ndarray, bits: int, order=None) -> np.ndarray:
    """AutoGPTQ's qzeros loop (``order`` None) or AutoAWQ's (``order`` = its order map)."""
    pf = 32 // bits
    values = values.astype(np.uint32)
    out = np.zeros((values.shape[0], values.shape[1] // pf), dtype=np.uint32)
    for col in range(out.shape[1]):
        for i in range(pf):
            source = col * pf + (order[i] if order else i)
            out[:, col] |= values[:, source] << (bits * i)
    return out.view(np.int32)


def write_gptq(q, scales, zeros, g_idx, bits: int, v2: bool = False) -> dict[str, torch.Tensor]:
    z = torch.full_like(scales, 2 ** (bits - 1), dtype=torch.int64) if zeros is None else zeros
    stored = (z - (0 if v2 else 1)).numpy()
    return {
        "qweight": torch.from_numpy(_pack_rows(q.numpy(), bits)),
        "qzeros": torch.from_numpy(_pack_columns(stored, bits)),
        "scales": scales.half(),
        "g_idx": g_idx.to(torch.int32),
    }


def write_awq(q, scales, zeros) -> dict[str, torch.Tensor]:
    return {
        "qweight": torch.from_numpy(_pack_columns(q.numpy(), 4, AWQ_ORDER_MAP)),
        "qzeros": torch.from_numpy(_pack_columns(zeros.numpy(), 4, AWQ_ORDER_MAP)),
        "scales": scales.half(),
    }


def write_compressed(q, scales, zeros, bits: int, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Through compressed-tensors' ``pack_to_int32`` (it takes signed values and adds the offset)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    offset = 2 ** (bits - 1)
    out = {
        "weight_packed": pack_to_int32((q.t() - offset).to(torch.int8).contiguous(), bits, packed_dim=1),
        "weight_scale": scales.t().contiguous().to(dtype),
        "weight_shape": torch.tensor([q.shape[1], q.shape[0]], dtype=torch.int64),
    }
    if zeros is not None:
        out["weight_zero_point"] = pack_to_int32((zeros.t() - offset).to(torch.int8).contiguous(), bits, packed_dim=0)
    return out


def _marlin_perms():
    """IST-DASLab Marlin's ``_get_perms``, as its paper's layout describes it."""
    perm = []
    for i in range(32):
        perm1 = []
        col = i // 4
        for block in [0, 1]:
            for row in [2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1]:
                perm1.append(16 * row + col + 8 * block)
        for j in range(4):
            perm.extend([p + 256 * j for p in perm1])
    perm = np.array(perm)
    interleave = np.array([0, 2, 4, 6, 1, 3, 5, 7])
    perm = perm.reshape((-1, 8))[:, interleave].ravel()
    scale_perm = []
    for i in range(8):
        scale_perm.extend([i + 8 * j for j in range(8)])
    scale_perm_single = []
    for i in range(4):
        scale_perm_single.extend([2 * i + j for j in [0, 1, 8, 9, 16, 17, 24, 25]])
    return perm, np.array(scale_perm), np.array(scale_perm_single)


def write_marlin(q, scales) -> dict[str, torch.Tensor]:
    """Marlin ``Layer.pack``'s steps on already-integer values (4-bit, symmetric, zero 8)."""
    perm, scale_perm, single = _marlin_perms()
    k, n = q.shape
    tile = 16
    s = scales.numpy().astype(np.float16)
    s = s.reshape((-1, len(scale_perm)))[:, scale_perm] if s.shape[0] > 1 else s.reshape((-1, len(single)))[:, single]
    s = s.reshape((-1, n))
    w = q.numpy().reshape((k // tile, tile, n // tile, tile)).transpose((0, 2, 1, 3)).reshape((k // tile, n * tile))
    res = w.reshape((-1, perm.size))[:, perm].reshape(w.shape).astype(np.uint32)
    packed = np.zeros((res.shape[0], res.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        packed |= res[:, i::8] << 4 * i
    return {
        "B": torch.from_numpy(packed.view(np.int32)),
        "s": torch.from_numpy(s.copy()),
        "workspace": torch.zeros(n // 128 * 16 if n >= 128 else 16, dtype=torch.int32),
    }
