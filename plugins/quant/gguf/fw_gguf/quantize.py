"""Quantize float matrices into GGUF blocks, in torch (on whatever device the tensor is on).

:func:`quantize` turns ``[rows, k]`` floats into the ``[rows, bytes_per_row]`` uint8 rows a GGUF
file of that type holds. The arithmetic follows llama.cpp's reference quantizers
(``quantize_row_*_ref`` in ggml-quants.c, what ``llama-quantize`` runs without an importance
matrix) step by step in float32, so the blocks are the ones llama.cpp writes: the simple types
here, the K-quants in :mod:`fw_gguf.kquants`. Block layouts (bytes, in order)::

    Q4_0  d f16 | qs[16]                 Q4_1  d f16 | m f16 | qs[16]
    Q5_0  d f16 | qh u32 | qs[16]        Q5_1  d f16 | m f16 | qh u32 | qs[16]
    Q8_0  d f16 | qs int8[32]            (qs[j]: value j in the low nibble, value j + 16 in the high one)
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from . import kquants


def f16_bytes(value: torch.Tensor) -> torch.Tensor:
    """``[B]`` float32 -> ``[B, 2]`` uint8: the IEEE half (round to nearest even), little-endian."""
    return value.to(torch.float16).contiguous().view(torch.uint8).view(-1, 2)


def u32_bytes(bits: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 holding 32-bit masks -> ``[B, 4]`` uint8, little-endian."""
    return torch.stack([(bits >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)


def nibbles(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Two int tensors of 4-bit values -> one uint8 tensor, ``low | high << 4``."""
    return ((low & 0xF) | ((high & 0xF) << 4)).to(torch.uint8)


def round_away(v: torch.Tensor) -> torch.Tensor:
    """C's ``roundf``: halves away from zero (torch.round rounds them to even)."""
    magnitude = v.abs()
    whole = magnitude.trunc()
    return torch.copysign(whole + (magnitude - whole >= 0.5).to(v.dtype), v)


def signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """Per row, the value of largest magnitude with its sign (the first one on ties, as llama.cpp's loops)."""
    return x.gather(-1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, kquants.div(1.0, d), torch.zeros_like(d))


def _q4_0(x: torch.Tensor) -> torch.Tensor:
    d = kquants.div(signed_absmax(x), -8.0)
    q = (x * _inverse(d)[:, None] + 8.5).trunc().clamp(max=15).to(torch.int32)
    return torch.cat([f16_bytes(d), nibbles(q[:, :16], q[:, 16:])], dim=1)


def _q4_1(x: torch.Tensor) -> torch.Tensor:
    low, high = x.amin(-1), x.amax(-1)
    d = kquants.div(high - low, 15.0)
    q = ((x - low[:, None]) * _inverse(d)[:, None] + 0.5).trunc().clamp(max=15).to(torch.int32)
    return torch.cat([f16_bytes(d), f16_bytes(low), nibbles(q[:, :16], q[:, 16:])], dim=1)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each of 32 values -> one 32-bit mask per block (value j at bit j)."""
    shifts = torch.arange(32, device=q.device, dtype=torch.int64)
    return (((q.to(torch.int64) >> 4) & 1) << shifts).sum(-1)


def _q5_0(x: torch.Tensor) -> torch.Tensor:
    d = kquants.div(signed_absmax(x), -16.0)
    q = (x * _inverse(d)[:, None] + 16.5).trunc().clamp(max=31).to(torch.int32)
    return torch.cat([f16_bytes(d), u32_bytes(_high_bits(q)), nibbles(q[:, :16], q[:, 16:])], dim=1)


def _q5_1(x: torch.Tensor) -> torch.Tensor:
    low, high = x.amin(-1), x.amax(-1)
    d = kquants.div(high - low, 31.0)
    q = ((x - low[:, None]) * _inverse(d)[:, None] + 0.5).trunc().to(torch.int32) & 0xFF  # C: (uint8_t), no clamp
    return torch.cat([f16_bytes(d), f16_bytes(low), u32_bytes(_high_bits(q)), nibbles(q[:, :16], q[:, 16:])], dim=1)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    d = kquants.div(x.abs().amax(-1), 127.0)
    q = round_away(x * _inverse(d)[:, None]).to(torch.int8)
    return torch.cat([f16_bytes(d), q.view(torch.uint8)], dim=1)


_QUANTIZERS = {
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0,
    Q.Q2_K: kquants.q2_k,
    Q.Q3_K: kquants.q3_k,
    Q.Q4_K: kquants.q4_k,
    Q.Q5_K: kquants.q5_k,
    Q.Q6_K: kquants.q6_k,
}
#: The GGUF types :func:`quantize` writes.
QUANTIZABLE_TYPES = tuple(_QUANTIZERS)

#: Values quantized per call: bounds the float32 temporaries (the K-quant searches hold several
#: copies of their input) whatever the matrix: under 1 GiB on the CPU, a few GiB on a GPU, where fewer,
#: larger calls spend less time launching the searches' thousands of small kernels.
_CHUNK_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 26}


def quantize(weight: torch.Tensor, qtype: Q) -> torch.Tensor:
    """``weight [rows, k]`` (any float dtype and device) as GGUF ``qtype`` blocks: ``[rows, bytes per row]``
    uint8 on the same device. ``k`` must be a whole number of the type's blocks."""
    if qtype not in _QUANTIZERS:
        raise ValueError(
            f"fw_gguf cannot quantize to {qtype.name}; it quantizes to {', '.join(t.name for t in QUANTIZABLE_TYPES)}"
        )
    rows, k = weight.shape
    block, type_size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise ValueError(f"{qtype.name} quantizes rows of whole {block}-value blocks; this matrix has {k} columns")
    out = torch.empty(rows, k // block * type_size, dtype=torch.uint8, device=weight.device)
    step = max(1, _CHUNK_ELEMENTS.get(weight.device.type, 1 << 24) // k)
    for start in range(0, rows, step):
        part = weight[start : start + step].float().reshape(-1, block)
        out[start : start + step] = _QUANTIZERS[qtype](part).reshape(-1, k // block * type_size)
    return out
