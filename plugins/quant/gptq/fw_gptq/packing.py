"""Integer packing of the W4A16 / W8A16 checkpoint formats, both ways, in torch.

Every format reduces to one canonical form (:class:`IntWeight`)::

    W[n, k] = (q[k, n] - zero[g(k), n]) * scale[g(k), n]        g(k) = g_idx[k], or k // group_size

with ``q`` / ``zero`` unsigned ``bits``-bit integers. How each format stores them (``pf = 32 // bits``
values per int32, value ``j`` of a word in bits ``[j * bits, (j + 1) * bits)``)::

    gptq          qweight [K/pf, N] (packed along K)   qzeros [G, N/pf] (along N), stored zero - 1
    gptq_v2       the same, zeros stored as they are
    awq (GEMM)    qweight [K, N/8]  (along N, nibble i holds column AWQ_ORDER[i] of its 8)
                  qzeros  [G, N/8]  (the same order)
    compressed-tensors pack-quantized
                  weight_packed [N, K/pf] (along K), signed values stored + 2**(bits-1);
                  weight_zero_point [N/pf, G] (along N, same offset), weight_scale [N, G]
    marlin (AutoGPTQ is_marlin_format, 4-bit symmetric): B [K/16, 2N] in Marlin's tile order
                  (:func:`marlin_perms`), s [G, N] with its scale permutation; zero 8

The packers exist for ``fw quantize`` and for tests; the unpackers for loading.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

#: AWQ GEMM: nibble ``i`` of a word holds column ``AWQ_ORDER[i]`` of the word's 8 columns.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class IntWeight(NamedTuple):
    """A weight in canonical integer form (see the module docstring). ``zeros`` None: symmetric,
    every zero ``2 ** (bits - 1)``; ``g_idx`` None: group ``k // group_size``."""

    q: Tensor  # uint8 [K, N]
    scales: Tensor  # float32 [G, N]
    zeros: Tensor | None  # uint8 [G, N]
    g_idx: Tensor | None  # int64 [K]
    bits: int
    group_size: int  # K for one group per output feature (channel-wise)

    def group_of(self) -> Tensor:
        """``g(k)`` for every input feature, int64 ``[K]``."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.q.shape[0], device=self.q.device) // self.group_size

    def zero_values(self) -> Tensor:
        """The zero points ``[G, N]`` as float32 (the symmetric constant where ``zeros`` is None)."""
        if self.zeros is None:
            return torch.full_like(self.scales, float(2 ** (self.bits - 1)))
        return self.zeros.float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``W`` ``[N, K]`` in ``dtype`` (computed in float32)."""
        groups = self.group_of()
        w = (self.q.float() - self.zero_values()[groups]) * self.scales.float()[groups]
        return w.t().contiguous().to(dtype)


def pack_along(values: Tensor, bits: int, dim: int) -> Tensor:
    """Pack unsigned ``bits``-bit ``values`` into int32 along ``dim`` (its size a multiple of 32 // bits)."""
    per_word = 32 // bits
    moved = values.movedim(dim, -1).to(torch.int64)
    moved = moved.reshape(*moved.shape[:-1], moved.shape[-1] // per_word, per_word)
    shifts = torch.arange(per_word, device=values.device) * bits
    words = (moved << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def unpack_along(words: Tensor, bits: int, dim: int) -> Tensor:
    """Inverse of :func:`pack_along`: uint8 values, ``dim`` ``32 // bits`` times longer."""
    per_word = 32 // bits
    moved = words.movedim(dim, -1).to(torch.int32)
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int32) * bits
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.reshape(*moved.shape[:-1], moved.shape[-1] * per_word).to(torch.uint8)
    return values.movedim(-1, dim).contiguous()


# --- GPTQ ---------------------------------------------------------------------------------------


def unpack_gptq(
    qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor | None, bits: int, group_size: int, zero_offset: int
) -> IntWeight:
    """GPTQ tensors -> :class:`IntWeight`; ``zero_offset`` is 1 for ``checkpoint_format: gptq`` (zeros
    stored minus one) and 0 for ``gptq_v2``."""
    q = unpack_along(qweight, bits, 0)
    zeros = (
        (unpack_along(qzeros, bits, 1).to(torch.int32) + zero_offset) & ((1 << bits) - 1)
        if zero_offset
        else unpack_along(qzeros, bits, 1)
    )
    return IntWeight(
        q, scales.float(), zeros.to(torch.uint8), None if g_idx is None else g_idx.long(), bits, group_size
    )


def pack_gptq(weight: IntWeight, zero_offset: int = 1) -> dict[str, Tensor]:
    """:class:`IntWeight` -> ``{qweight, qzeros, scales (fp16), g_idx}`` (v1 convention for offset 1).
    A zero of 0 has no v1 encoding (it would store -1); such weights need ``gptq_v2``."""
    zeros = (
        weight.zeros.to(torch.int32)
        if weight.zeros is not None
        else torch.full_like(weight.scales, 2 ** (weight.bits - 1), dtype=torch.int32)
    )
    if zero_offset and bool((zeros == 0).any()):
        raise ValueError("a zero point of 0 cannot be stored in checkpoint_format gptq (v1); use gptq_v2")
    return {
        "qweight": pack_along(weight.q, weight.bits, 0),
        "qzeros": pack_along((zeros - zero_offset).to(torch.uint8), weight.bits, 1),
        "scales": weight.scales.to(torch.float16),
        "g_idx": weight.group_of().to(torch.int32),
    }


# --- AWQ ----------------------------------------------------------------------------------------


def _awq_columns(values: Tensor, inverse: bool) -> Tensor:
    """Reorder each run of 8 columns into (or, ``inverse``, out of) AWQ's nibble order."""
    order = torch.tensor(AWQ_ORDER, device=values.device)
    if inverse:
        order = torch.argsort(order)
    grouped = values.reshape(*values.shape[:-1], -1, 8)
    return grouped.index_select(-1, order).reshape(values.shape)


def unpack_awq(qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int) -> IntWeight:
    """AWQ GEMM tensors (4-bit) -> :class:`IntWeight`."""
    q = _awq_columns(unpack_along(qweight, 4, 1), inverse=True)
    zeros = _awq_columns(unpack_along(qzeros, 4, 1), inverse=True)
    return IntWeight(q, scales.float(), zeros, None, 4, group_size)


def pack_awq(weight: IntWeight) -> dict[str, Tensor]:
    """:class:`IntWeight` (4-bit, no g_idx) -> ``{qweight, qzeros, scales (fp16)}``."""
    zeros = weight.zeros if weight.zeros is not None else torch.full_like(weight.scales, 8, dtype=torch.uint8)
    return {
        "qweight": pack_along(_awq_columns(weight.q, inverse=False), 4, 1),
        "qzeros": pack_along(_awq_columns(zeros, inverse=False), 4, 1),
        "scales": weight.scales.to(torch.float16),
    }


# --- compressed-tensors pack-quantized ----------------------------------------------------------


def unpack_compressed(
    weight_packed: Tensor,
    weight_scale: Tensor,
    weight_zero_point: Tensor | None,
    g_idx: Tensor | None,
    bits: int,
    group_size: int,
) -> IntWeight:
    """compressed-tensors ``pack-quantized`` tensors -> :class:`IntWeight` (the stored offset
    ``2 ** (bits - 1)`` is the symmetric zero, so the unsigned values are used as stored)."""
    q = unpack_along(weight_packed, bits, 1).t().contiguous()
    zeros = None if weight_zero_point is None else unpack_along(weight_zero_point, bits, 0).t().contiguous()
    return IntWeight(
        q, weight_scale.float().t().contiguous(), zeros, None if g_idx is None else g_idx.long(), bits, group_size
    )


def pack_compressed(weight: IntWeight, dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
    """:class:`IntWeight` -> ``{weight_packed, weight_scale, weight_shape[, weight_zero_point]}``."""
    n = weight.q.shape[1]
    out = {
        "weight_packed": pack_along(weight.q.t(), weight.bits, 1),
        "weight_scale": weight.scales.t().contiguous().to(dtype),
        "weight_shape": torch.tensor([n, weight.q.shape[0]], dtype=torch.int64),
    }
    if weight.zeros is not None:
        out["weight_zero_point"] = pack_along(weight.zeros.t(), weight.bits, 0)
    return out


# --- Marlin (AutoGPTQ is_marlin_format) ---------------------------------------------------------


def marlin_perms() -> tuple[Tensor, Tensor, Tensor]:
    """``(weight perm [1024], scale perm [64], channel-wise scale perm [32])`` of the Marlin layout: the
    order in which one 16x64 block of tiles' values feed its tensor-core fragments."""
    perm = []
    for i in range(32):
        fragment = [
            16 * row + i // 4 + 8 * block
            for block in (0, 1)
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1)
        ]
        for j in range(4):
            perm.extend(p + 256 * j for p in fragment)
    interleave = np.array([0, 2, 4, 6, 1, 3, 5, 7])
    weight_perm = np.array(perm).reshape(-1, 8)[:, interleave].ravel()
    scale_perm = [i + 8 * j for i in range(8) for j in range(8)]
    single = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    return torch.from_numpy(weight_perm), torch.tensor(scale_perm), torch.tensor(single)


def unpack_marlin(packed: Tensor, scales: Tensor, group_size: int) -> IntWeight:
    """Marlin ``B [K/16, 2N]`` and ``s [G, N]`` -> :class:`IntWeight` (4-bit, symmetric)."""
    weight_perm, scale_perm, single = marlin_perms()
    tiles = unpack_along(packed, 4, 1)  # [K/16, 16N], permuted
    k, n = tiles.shape[0] * 16, tiles.shape[1] // 16
    blocks = tiles.reshape(-1, weight_perm.numel())
    unpermuted = torch.empty_like(blocks)
    unpermuted[:, weight_perm] = blocks
    q = unpermuted.reshape(k // 16, n // 16, 16, 16).permute(0, 2, 1, 3).reshape(k, n)
    perm = single if scales.shape[0] == 1 else scale_perm
    flat = scales.reshape(-1, perm.numel())
    restored = torch.empty_like(flat)
    restored[:, perm] = flat
    return IntWeight(q.contiguous(), restored.reshape(scales.shape).float(), None, None, 4, group_size)


def pack_marlin(weight: IntWeight) -> dict[str, Tensor]:
    """:class:`IntWeight` (4-bit symmetric, K % 16 == 0, N % 64 == 0) -> ``{B, s}``."""
    weight_perm, scale_perm, single = marlin_perms()
    k, n = weight.q.shape
    tiles = weight.q.reshape(k // 16, 16, n // 16, 16).permute(0, 2, 1, 3).reshape(k // 16, 16 * n)
    tiles = tiles.reshape(-1, weight_perm.numel())[:, weight_perm].reshape(k // 16, 16 * n)
    perm = single if weight.scales.shape[0] == 1 else scale_perm
    s = weight.scales.reshape(-1, perm.numel())[:, perm].reshape(weight.scales.shape)
    return {"B": pack_along(tiles, 4, 1), "s": s.to(torch.float16)}
