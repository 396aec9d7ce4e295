"""The torch reference of quantized KV caches: rotate, quantize, pack, store, and their inverses.

Backends that read a quantized cache (:mod:`framework.kv_cache` describes the layout) must agree
with these functions bit for bit on what is stored; the torch backend uses them directly, the
Triton kernels are tested against them.

Key rotation (turbo dtypes): per KV head ``h`` a fixed random sign vector ``s_h`` and the
normalized Walsh-Hadamard matrix ``W`` (``W @ W = I``) give the orthonormal map
``k -> W (s_h * k)``. Absmax scales of rotated rows waste little range on outlier channels, and
``q . k == rotate(q) . rotate(k)``, so scores are taken in the rotated space with the query
rotated the same way. Values may be rotated too (the turbo dtypes do: 4-bit values lose half the
KL divergence to the ``auto`` cache that way, docs/kv-cache-quantization.md): the attention output
is then in the rotated space, and ``unrotate`` of it is the output. ``W`` is applied as one ``[D, D]`` matmul (one
GEMM per step for ``D <= 256``; fast-hadamard-transform, the maintained fast version, is a
CUDA-only source build).
"""

from __future__ import annotations

import functools

import torch

from framework.kv_cache import FORMAT_BITS, LOG_SCALE_STEPS, LOG_SCALE_ZERO, KVCache

FP8_MAX = 448.0  # largest finite float8_e4m3fn


@functools.cache
def _hadamard(size: int, device: torch.device) -> torch.Tensor:
    if size & (size - 1):
        raise ValueError(f"the Walsh-Hadamard rotation needs a power-of-two head size, got {size}")
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return (matrix / size**0.5).to(device)


def hadamard(size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized Sylvester-Hadamard matrix ``[size, size]`` (symmetric, its own inverse), float32;
    built once per device (a backend builds it in ``initialize``, before any CUDA-graph capture)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _hadamard(size, device)


def random_signs(num_heads: int, head_size: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[num_heads, head_size]`` float32 ±1, the same for the same ``seed`` on every machine."""
    generator = torch.Generator().manual_seed(0x7B0 + seed)
    bits = torch.randint(0, 2, (num_heads, head_size), generator=generator)
    return (bits * 2 - 1).float().to(device)


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, H, D]`` rotated per head: ``W (s * x)`` in float32. ``signs`` ``[H_kv, D]`` serve
    ``H / H_kv`` consecutive heads each (queries of a KV head share its rotation).

    Two kernels on the decode hot path: the sign flip, broadcast over a KV head's queries, also
    casts to float32 (exact either way), then the one GEMM by ``W``."""
    num_tokens, num_heads, head_size = x.shape
    flipped = x.view(num_tokens, signs.shape[0], num_heads // signs.shape[0], head_size) * signs[:, None]
    return flipped.view(num_tokens, num_heads, head_size) @ hadamard(head_size, x.device)


def unrotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rotate` (``s * (W x)``)."""
    num_tokens, num_heads, head_size = x.shape
    turned = (x.float() @ hadamard(head_size, x.device)).view(num_tokens, signs.shape[0], -1, head_size)
    return (turned * signs[:, None]).view(num_tokens, num_heads, head_size)


def encode_scale(scale: torch.Tensor) -> torch.Tensor:
    """Log-coded scale bytes, rounded up (a code never means less than ``scale``)."""
    code = torch.ceil(torch.log2(scale.float().clamp_min(2.0**-16)) * LOG_SCALE_STEPS) + LOG_SCALE_ZERO
    return code.clamp(0, 255).to(torch.uint8)


def decode_scale(code: torch.Tensor) -> torch.Tensor:
    """The float32 scale a code byte means."""
    return torch.exp2((code.float() - LOG_SCALE_ZERO) / LOG_SCALE_STEPS)


def code_range(row_format: str) -> float:
    """The largest magnitude a code stands for, in scale units (fp8: 448; int b: ``(2^b - 1) / 2``)."""
    return FP8_MAX if row_format == "fp8" else (2 ** FORMAT_BITS[row_format] - 1) / 2


def quantize_rows(
    x: torch.Tensor, row_format: str, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` as ``(codes uint8 [..., D * bits / 8], scale codes uint8 [...])``; the
    scale is the row's absmax over :func:`code_range` unless ``scale`` (broadcast over rows) is given."""
    x = x.float()
    if scale is None:
        scale = x.abs().amax(-1) / code_range(row_format)
    scale_code = encode_scale(scale.expand(x.shape[:-1]))
    units = x / decode_scale(scale_code)[..., None]
    if row_format == "fp8":
        return units.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8), scale_code
    half = code_range(row_format)
    codes = torch.floor(units + (half + 0.5)).clamp(0, 2 * half).to(torch.int32)  # round half up, as the kernels
    return pack_codes(codes, FORMAT_BITS[row_format]), scale_code


def dequantize_rows(codes: torch.Tensor, scale_code: torch.Tensor, row_format: str, head_size: int) -> torch.Tensor:
    """The float32 rows ``[..., head_size]`` that :func:`quantize_rows` stored."""
    if row_format == "fp8":
        units = codes.contiguous().view(torch.float8_e4m3fn).float()
    else:
        units = unpack_codes(codes, FORMAT_BITS[row_format], head_size).float() - code_range(row_format)
    return units * decode_scale(scale_code)[..., None]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes ``[..., D]`` (each ``< 2^bits``) as a little-endian bit stream of bytes."""
    if bits == 4:
        return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    if bits == 3:  # 8 codes -> one 24-bit word -> 3 bytes
        groups = codes.unflatten(-1, (-1, 8))
        word = (groups << (3 * torch.arange(8, device=codes.device))).sum(-1)
        packed = torch.stack([(word >> shift) & 0xFF for shift in (0, 8, 16)], -1)
        return packed.flatten(-2).to(torch.uint8)
    raise ValueError(f"no packing for {bits}-bit codes")


def unpack_codes(packed: torch.Tensor, bits: int, head_size: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes`: int32 codes ``[..., head_size]``."""
    data = packed.to(torch.int32)
    if bits == 4:
        return torch.stack([data & 0xF, data >> 4], -1).flatten(-2)
    if bits == 3:
        groups = data.unflatten(-1, (-1, 3))
        word = groups[..., 0] | (groups[..., 1] << 8) | (groups[..., 2] << 16)
        codes = (word[..., None] >> (3 * torch.arange(8, device=packed.device))) & 7
        return codes.flatten(-2)[..., :head_size]
    raise ValueError(f"no packing for {bits}-bit codes")


def quantize_kv(cache: KVCache, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows ``[T, H_kv, key_bytes + value_bytes]`` and scale codes ``[T, H_kv, 2]`` that
    ``key``/``value`` ``[T, H_kv, D]`` are stored as in ``cache`` (rotated first where its dtype says so)."""
    spec = cache.spec
    if spec.rotate_keys:
        key = rotate(key, cache.rotation_signs)
    if spec.rotate_values:
        value = rotate(value, cache.rotation_signs)
    static_k = cache.k_scale if spec.key_format == "fp8" else None  # checkpoint scales are fp8 calibrations
    static_v = cache.v_scale if spec.value_format == "fp8" else None
    key_codes, key_scale = quantize_rows(key, spec.key_format, None if static_k is None else static_k[None])
    value_codes, value_scale = quantize_rows(value, spec.value_format, None if static_v is None else static_v[None])
    return torch.cat([key_codes, value_codes], -1), torch.stack([key_scale, value_scale], -1)


def dequantize_kv(cache: KVCache, rows: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[..., H_kv, D]`` (float32; still rotated where the dtype rotates them) from
    stored rows and scale codes."""
    spec = cache.spec
    key_bytes = rows.shape[-1] - (FORMAT_BITS[spec.value_format] * spec.head_size) // 8
    keys = dequantize_rows(rows[..., :key_bytes], scales[..., 0], spec.key_format, spec.head_size)
    values = dequantize_rows(rows[..., key_bytes:], scales[..., 1], spec.value_format, spec.head_size)
    return keys, values


def query_space(cache: KVCache, query: torch.Tensor) -> torch.Tensor:
    """``query`` ``[T, H, D]`` in the space ``cache``'s keys are stored in (rotated, in its dtype, for
    rotated-key dtypes; else unchanged)."""
    if cache.spec is None or not cache.spec.rotate_keys:
        return query
    return rotate(query, cache.rotation_signs).to(query.dtype)


def output_space(cache: KVCache, output: torch.Tensor) -> torch.Tensor:
    """The attention output ``[T, H, D]`` computed over ``cache``'s stored values, back in the model's
    space (unrotated, in its dtype, for rotated-value dtypes; else unchanged)."""
    if cache.spec is None or not cache.spec.rotate_values:
        return output
    return unrotate(output, cache.rotation_signs).to(output.dtype)


def store_quantized(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[T, H_kv, D]`` into their slots (negative slots are skipped)."""
    rows, scales = quantize_kv(cache, key, value)
    keep = slot_mapping >= 0
    num_blocks, block_size, num_heads, width = cache.data.shape
    cache.data.view(num_blocks * block_size, num_heads, width)[slot_mapping[keep]] = rows[keep]
    cache.scales.view(num_blocks * block_size, num_heads, 2)[slot_mapping[keep]] = scales[keep]


def gather_dequantized(cache: KVCache, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of ``block_ids`` (any shape ``[...]``) as float32 ``[..., block_size, H_kv, D]``."""
    return dequantize_kv(cache, cache.data[block_ids], cache.scales[block_ids])
