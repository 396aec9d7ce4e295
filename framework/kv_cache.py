"""One layer's KV cache: the spec a backend declares for a (layer, KV dtype), and the object
``AttentionBackend.forward`` receives (data plus side buffers).

KV dtypes (``--kv-cache-dtype``, registered through ``register_kv_cache_dtypes``) say how a key
and a value row of one head are stored: ``model`` (the model dtype, ``auto``), ``fp8`` (e4m3),
``int4`` or ``int3`` (uniform mid-rise codes, ``(code - (2^b - 1) / 2) * scale``); turbo dtypes
rotate keys and values first (:mod:`framework.kv_quant`).

Quantized layout (``kv_dtype != "auto"``, standard layout only)::

    data   uint8 [num_blocks, block_size, H_kv, key_bytes + value_bytes]   key codes, then value codes
    scales uint8 [num_blocks, block_size, H_kv, 2]                         log-coded absmax scales: key, value

``key_bytes = D * key_bits / 8``. A scale byte ``c`` means ``2 ** ((c - 128) / 8)`` (an eighth of
an octave per step, 2^-16 .. 2^16): computed per token and head when the row is stored, rounded
up so no code clips. One byte instead of two keeps the side buffer at 1/64 of an fp8 row of 128.

Int4 codes pack two per byte (dim ``2j`` in the low nibble); int3 codes form a little-endian bit
stream (dim ``d`` at bits ``3d .. 3d + 2``), 8 dims per 3 bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: bits per element of each row format (``model``: the model dtype's own size)
FORMAT_BITS = {"fp8": 8, "int4": 4, "int3": 3}
#: log-scale code: ``scale = 2 ** ((code - LOG_SCALE_ZERO) / LOG_SCALE_STEPS)``
LOG_SCALE_STEPS = 8
LOG_SCALE_ZERO = 128


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What one layer's cache holds: named tensors ``(name, shape, dtype)`` whose first dim is the
    block count (``-1`` here). ``key_format`` / ``value_format`` / ``rotate_keys`` come from the KV
    dtype; ``head_size`` is the unpacked row width."""

    kv_dtype: str
    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # exactly one -1 per shape
    block_size: int
    key_format: str = "model"
    value_format: str = "model"
    rotate_keys: bool = False
    rotate_values: bool = False
    num_kv_heads: int = 0
    head_size: int = 0

    @property
    def bytes_per_block(self) -> int:
        """Device bytes of one block over every tensor of the layer."""
        return sum(-math.prod(shape) * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in self.tensors)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    def allocate(self, num_blocks: int, device: torch.device, seed: int = 0) -> KVCache:
        """A zeroed cache of ``num_blocks`` blocks; rotated dtypes get their random signs from ``seed``
        (the engine passes the layer index, so layers rotate differently and runs repeat)."""
        from framework.kv_quant import random_signs

        made = {
            name: torch.zeros(tuple(num_blocks if d == -1 else d for d in shape), dtype=dtype, device=device)
            for name, shape, dtype in self.tensors
        }
        rotated = self.rotate_keys or self.rotate_values
        signs = random_signs(self.num_kv_heads, self.head_size, seed, device) if rotated else None
        return KVCache(made.pop("data"), self, scales=made.pop("scales", None), rotation_signs=signs)


@dataclass(slots=True)
class KVCache:
    """One layer's cache as a backend reads it.

    ``data`` is the cache tensor (``auto``: the model-dtype ``[2, num_blocks, block_size, H_kv, D]``
    standard or ``[num_blocks, block_size, L + R]`` MLA tensor; quantized: the uint8 rows of the
    module docstring), ``scales`` the per-token-head log scale codes. ``rotation_signs`` (``[H_kv, D]``,
    ±1, rotated dtypes) are the random sign flips of the rotation of keys (and values, where the
    dtype rotates them: :func:`framework.kv_quant.rotate`). ``k_scale`` / ``v_scale`` (``[H_kv]`` float32, or None)
    are checkpoint scales: when set, rows are stored with them instead of their own absmax.
    """

    data: torch.Tensor
    spec: KVCacheSpec | None = None
    scales: torch.Tensor | None = None
    rotation_signs: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def kv_dtype(self) -> str:
        return "auto" if self.spec is None else self.spec.kv_dtype

    @property
    def is_quantized(self) -> bool:
        return self.scales is not None

    @property
    def block_size(self) -> int:
        return self.data.shape[1] if self.is_quantized or self.data.dim() == 3 else self.data.shape[2]


def model_cache_spec(kv_dtype: str, shape: tuple[int, ...], dtype: torch.dtype, block_size: int) -> KVCacheSpec:
    """The spec of a cache kept in the model dtype: one tensor of ``shape`` (block dim ``-1``)."""
    return KVCacheSpec(kv_dtype, (("data", shape, dtype),), block_size)


def quantized_cache_spec(
    kv_dtype: str,
    key_format: str,
    value_format: str,
    rotate_keys: bool,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    rotate_values: bool = False,
) -> KVCacheSpec:
    """The spec of a standard-layout cache stored as ``key_format`` / ``value_format`` rows."""
    key_bytes = row_bytes(key_format, head_size)
    value_bytes = row_bytes(value_format, head_size)
    tensors = (
        ("data", (-1, block_size, num_kv_heads, key_bytes + value_bytes), torch.uint8),
        ("scales", (-1, block_size, num_kv_heads, 2), torch.uint8),
    )
    return KVCacheSpec(
        kv_dtype, tensors, block_size, key_format, value_format, rotate_keys, rotate_values, num_kv_heads, head_size
    )


def row_bytes(row_format: str, head_size: int) -> int:
    """Bytes of one head's row of ``head_size`` elements in ``row_format``."""
    bits = FORMAT_BITS[row_format] * head_size
    if bits % 8:
        raise ValueError(f"{row_format} rows of {head_size} elements do not fill whole bytes")
    return bits // 8
