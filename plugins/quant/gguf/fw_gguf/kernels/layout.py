"""The GGUF block fields the kernels decode, and the planar layout (see :mod:`fw_gguf.kernels.decode`)
the GPU keeps matrix weights in: plain torch, importable without Triton."""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

#: Each type's block fields as ``(start, size)`` bytes, in block order; they tile the block.
FIELDS: dict[GGMLQuantizationType, tuple[tuple[int, int], ...]] = {
    Q.Q4_0: ((0, 2), (2, 16)),
    Q.Q4_1: ((0, 2), (2, 2), (4, 16)),
    Q.Q5_0: ((0, 2), (2, 4), (6, 16)),
    Q.Q5_1: ((0, 2), (2, 2), (4, 4), (8, 16)),
    Q.Q8_0: ((0, 2), (2, 32)),
    Q.Q2_K: ((0, 16), (16, 64), (80, 2), (82, 2)),
    Q.Q3_K: ((0, 32), (32, 64), (96, 12), (108, 2)),
    Q.Q4_K: ((0, 2), (2, 2), (4, 12), (16, 128)),
    Q.Q5_K: ((0, 2), (2, 2), (4, 12), (16, 32), (48, 128)),
    Q.Q6_K: ((0, 128), (128, 64), (192, 16), (208, 2)),
    Q.IQ4_NL: ((0, 2), (2, 16)),
    Q.IQ4_XS: ((0, 2), (2, 2), (4, 4), (8, 128)),
}

#: Types the kernels decode: ``(groups G, group size S)`` per block.
GROUPS: dict[GGMLQuantizationType, tuple[int, int]] = {
    Q.Q4_0: (1, 32),
    Q.Q4_1: (1, 32),
    Q.Q5_0: (1, 32),
    Q.Q5_1: (1, 32),
    Q.Q8_0: (1, 32),
    Q.IQ4_NL: (1, 32),
    Q.Q2_K: (16, 16),
    Q.Q3_K: (16, 16),
    Q.Q6_K: (16, 16),
    Q.Q4_K: (8, 32),
    Q.Q5_K: (8, 32),
    Q.IQ4_XS: (8, 32),
}
KERNEL_TYPES: frozenset[GGMLQuantizationType] = frozenset(GROUPS)


def to_planar(packed: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """GGUF bytes (any shape, whole blocks) -> the planar layout, flat uint8 of the same size."""
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = packed.reshape(-1, type_size)
    return torch.cat([blocks[:, start : start + size].reshape(-1) for start, size in FIELDS[qtype]])


def from_planar(planar: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """The inverse of :func:`to_planar`: GGUF blocks ``[T, type_size]``."""
    type_size = GGML_QUANT_SIZES[qtype][1]
    total = planar.numel() // type_size
    return torch.cat(
        [planar[total * start : total * (start + size)].view(total, size) for start, size in FIELDS[qtype]], dim=1
    )


def experts_to_planar(stack: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """An expert stack ``[E, rows, bytes_per_row]`` -> each expert's matrix in the planar layout, same shape."""
    experts, type_size = stack.shape[0], GGML_QUANT_SIZES[qtype][1]
    blocks = stack.reshape(experts, -1, type_size)
    return torch.cat(
        [blocks[:, :, start : start + size].reshape(experts, -1) for start, size in FIELDS[qtype]], dim=1
    ).view(stack.shape)


def experts_from_planar(stack: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """The inverse of :func:`experts_to_planar`: ``[E, rows, bytes_per_row]`` in the GGUF block layout."""
    experts, type_size = stack.shape[0], GGML_QUANT_SIZES[qtype][1]
    flat = stack.reshape(experts, -1)
    total = flat.shape[1] // type_size
    return torch.cat(
        [
            flat[:, total * start : total * (start + size)].reshape(experts, total, size)
            for start, size in FIELDS[qtype]
        ],
        dim=2,
    ).view(stack.shape)
