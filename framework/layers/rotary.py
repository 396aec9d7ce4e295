"""Rotary position embeddings: a precomputed cos/sin table and the registry's ``rotary_embedding``.

:func:`get_rope` reads a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict and returns
the module for its type: default, ``linear``, ``dynamic`` (NTK), ``llama3``, ``yarn``,
``longrope``, ``proportional`` (Gemma 4). Each type only changes the inverse frequencies, the attention scaling folded into
cos/sin, and how many positions the table holds; the frequencies are computed with the same
float32 arithmetic as ``transformers.modeling_rope_utils`` so the two agree bit for bit.

The table is derived state, not a weight: a non-persistent buffer ``cos_sin_cache``
``[num_positions, rotary_dim]`` (cos half, then sin half). It is computed at construction,
except on the ``meta`` device, by :meth:`RotaryEmbedding.init_buffers`, and again whenever the
module moves (``to()``, ``to_empty()``), so a model materialised from ``meta`` never sees an
uninitialised table and the table stays in its own dtype (float32) when the model is cast.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch
from torch import Tensor, nn

from framework import kernels, ops, plugins
from framework.kernels import get_kernel
from framework.layers.layernorm import norm_per_head


def default_inv_freq(base: float, rotary_dim: int) -> Tensor:
    """``1 / base^(2i / rotary_dim)`` for ``i < rotary_dim / 2`` (float32, as transformers)."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


class RotaryEmbedding(nn.Module):
    """Default RoPE. ``forward(positions, query, key) -> (query, key)`` rotated.

    ``query`` is ``[num_tokens, num_heads * head_size]`` and ``key`` ``[num_tokens,
    num_kv_heads * head_size]``; the first ``rotary_dim`` features of each head rotate.
    ``is_neox_style`` pairs feature i with i + rotary_dim/2 (Llama), otherwise 2i with 2i+1
    (GPT-J). Subclasses set their own attributes before calling this constructor, since it
    builds the table.
    """

    attention_scaling: float = 1.0

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.head_size, self.rotary_dim = head_size, rotary_dim
        self.max_position_embeddings, self.base = max_position_embeddings, base
        self.is_neox_style, self.dtype = is_neox_style, dtype
        self._kernel = get_kernel("rotary_embedding")
        self._qk_norm_kernel = get_kernel("qk_norm_rotary_embedding")
        cache = torch.empty(self.num_cached_positions(), rotary_dim, dtype=dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        if cache.device.type != "meta":  # under `with torch.device("meta")` there is nothing to compute on
            self.init_buffers(cache.device)

    def num_cached_positions(self) -> int:
        """Rows of the table: the largest position this module can rotate, plus one."""
        return self.max_position_embeddings

    def compute_inv_freq(self) -> Tensor:
        """The ``rotary_dim / 2`` inverse frequencies, float32 on the CPU."""
        return default_inv_freq(self.base, self.rotary_dim)

    def init_buffers(self, device: torch.device | str) -> None:
        """(Re)compute ``cos_sin_cache`` on ``device`` (float32 arithmetic, stored as ``dtype``)."""
        with torch.device("cpu"):  # the frequencies on the CPU, like transformers, whatever the device context
            inv_freq = self.compute_inv_freq()
        self.cos_sin_cache = self._cos_sin(inv_freq, self.num_cached_positions(), torch.device(device)).to(self.dtype)

    def _cos_sin(self, inv_freq: Tensor, num_positions: int, device: torch.device) -> Tensor:
        positions = torch.arange(num_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq.to(device))
        return torch.cat((freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling), dim=-1)

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        super()._apply(fn, recurse)
        if self.cos_sin_cache.device.type != "meta":  # to_empty() leaves garbage; .half() would lose precision
            self.init_buffers(self.cos_sin_cache.device)
        return self

    def table_positions(self, positions: Tensor) -> Tensor:
        """The rows of ``cos_sin_cache`` that rotate tokens at ``positions`` (the positions themselves here)."""
        return positions

    def forward(self, positions: Tensor, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        return self._kernel(
            self.table_positions(positions), query, key, self.head_size, self.cos_sin_cache, self.is_neox_style
        )

    def forward_with_qk_norm(
        self, positions: Tensor, query: Tensor, key: Tensor, q_norm: nn.Module, k_norm: nn.Module
    ) -> tuple[Tensor, Tensor]:
        """:meth:`forward` of ``query`` and ``key`` with every head first normalised by ``q_norm`` /
        ``k_norm`` (:class:`~framework.layers.RMSNorm` over ``head_size``, Qwen3's and Gemma 3's
        QK norm): the ``qk_norm_rotary_embedding`` op, one kernel where a plugin provides it. Without
        one, the norms and :meth:`forward` run the ``rms_norm`` and ``rotary_embedding`` kernels
        the registry chose (not the op's torch reference, which would bypass them)."""
        if (q_norm.eps, q_norm.offset) != (k_norm.eps, k_norm.offset):
            raise ValueError(f"the query and key norms differ in eps or offset: {q_norm} / {k_norm}")
        if self._qk_norm_kernel is ops.qk_norm_rotary_embedding:
            return self.forward(
                positions, norm_per_head(q_norm, query, self.head_size), norm_per_head(k_norm, key, self.head_size)
            )
        return self._qk_norm_kernel(
            self.table_positions(positions),
            query,
            key,
            self.head_size,
            self.cos_sin_cache,
            self.is_neox_style,
            q_norm.weight,
            k_norm.weight,
            q_norm.eps,
            q_norm.offset,
        )

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position_embeddings}, "
            f"base={self.base}, is_neox_style={self.is_neox_style}"
        )


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """Position interpolation: frequencies divided by ``factor``; the table covers ``factor`` x positions."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        *,
        factor: float,
    ) -> None:
        self.factor = factor
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def num_cached_positions(self) -> int:
        # Models pass their context length, which for linear scaling already includes the factor
        # (Gemma 3 4B: 131072 with factor 8); a table of max_position * factor rows would be 8x too big.
        return self.max_position_embeddings

    def compute_inv_freq(self) -> Tensor:
        return default_inv_freq(self.base, self.rotary_dim) / self.factor


class DynamicNTKScalingRotaryEmbedding(RotaryEmbedding):
    """NTK-aware scaling, fixed at the longest context (vLLM's static form of "dynamic").

    The base is enlarged for ``max_position_embeddings * factor`` positions. transformers
    recomputes the base per sequence length instead: equal to this table for sequences of that
    full length, and plain default RoPE for sequences within ``max_position_embeddings``.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        *,
        factor: float,
    ) -> None:
        self.factor = factor
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def num_cached_positions(self) -> int:
        return int(self.max_position_embeddings * self.factor)

    def compute_inv_freq(self) -> Tensor:
        max_len, dim, factor = self.max_position_embeddings * self.factor, self.rotary_dim, self.factor
        base = self.base * ((factor * max_len / self.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return default_inv_freq(base, dim)


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1: low frequencies divided by ``factor``, high ones kept, a smooth ramp between."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        *,
        factor: float,
        low_freq_factor: float,
        high_freq_factor: float,
        original_max_position_embeddings: int,
    ) -> None:
        self.factor, self.low_freq_factor, self.high_freq_factor = factor, low_freq_factor, high_freq_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def compute_inv_freq(self) -> Tensor:
        inv_freq = default_inv_freq(self.base, self.rotary_dim)
        factor, low, high, old_len = (
            self.factor,
            self.low_freq_factor,
            self.high_freq_factor,
            self.original_max_position_embeddings,
        )
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class YaRNScalingRotaryEmbedding(RotaryEmbedding):
    """YaRN: interpolate low frequencies, extrapolate high ones (ramp between ``beta_slow`` and
    ``beta_fast`` rotations over the original context); the attention factor scales cos/sin."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        *,
        factor: float,
        original_max_position_embeddings: int,
        beta_fast: float = 32,
        beta_slow: float = 1,
        mscale: float | None = None,
        mscale_all_dim: float | None = None,
        attention_factor: float | None = None,
        truncate: bool = True,
    ) -> None:
        self.factor, self.original_max_position_embeddings = factor, original_max_position_embeddings
        self.beta_fast, self.beta_slow, self.truncate = beta_fast, beta_slow, truncate
        if attention_factor is None:
            if mscale and mscale_all_dim:  # DeepSeek: the ratio of two temperatures
                attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
            else:
                attention_factor = yarn_get_mscale(factor)
        self.attention_scaling = float(attention_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def num_cached_positions(self) -> int:
        return max(self.max_position_embeddings, int(self.original_max_position_embeddings * self.factor))

    def compute_inv_freq(self) -> Tensor:
        dim, base = self.rotary_dim, self.base

        def correction_dim(num_rotations: float) -> float:  # the dimension that turns num_rotations times
            return (
                dim
                * math.log(self.original_max_position_embeddings / (num_rotations * 2 * math.pi))
                / (2 * math.log(base))
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        extrapolation_weight = 1 - ramp
        return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


class ProportionalRotaryEmbedding(RotaryEmbedding):
    """Gemma 4's global layers: the first ``rotated_dim / 2`` frequencies of a full-width rotation,
    ``1 / base^(2i / head_size) / factor``, the others zero (those features pass through).

    Unlike partial rotary (``rotary_dim < head_size``, whose frequencies span the rotating
    features), the rotation keeps the whole head's pairing: feature ``i`` with ``i + head_size / 2``
    (neox style), so the table is ``head_size`` wide.
    """

    def __init__(
        self,
        head_size: int,
        rotated_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        *,
        factor: float = 1.0,
    ) -> None:
        if rotated_dim % 2 or not 0 <= rotated_dim <= head_size:
            raise ValueError(f"proportional rope rotates an even number of features <= {head_size}; got {rotated_dim}")
        self.rotated_dim, self.factor = rotated_dim, factor
        super().__init__(head_size, head_size, max_position_embeddings, base, is_neox_style, dtype)

    def compute_inv_freq(self) -> Tensor:
        rotated = default_inv_freq(self.base, self.head_size)[: self.rotated_dim // 2]
        return torch.cat([rotated, torch.zeros(self.head_size // 2 - self.rotated_dim // 2)]) / self.factor


class LongRopeScaledRotaryEmbedding(RotaryEmbedding):
    """Phi-3 LongRoPE: per-frequency ``short_factor`` within the original context, ``long_factor``
    beyond it. The table holds both: rows ``[0, original)`` short, then ``max_position`` long rows.

    As in transformers the choice is per forward call: when any position reaches the original
    context, every token of the call uses the long factors (vLLM does the same per batch).
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        *,
        original_max_position_embeddings: int,
        short_factor: tuple[float, ...],
        long_factor: tuple[float, ...],
        factor: float | None = None,
        attention_factor: float | None = None,
    ) -> None:
        self.original_max_position_embeddings = original_max_position_embeddings
        self.short_factor, self.long_factor = tuple(short_factor), tuple(long_factor)
        if not len(self.short_factor) == len(self.long_factor) == rotary_dim // 2:
            raise ValueError(
                f"longrope needs rotary_dim / 2 = {rotary_dim // 2} short and long factors, "
                f"got {len(self.short_factor)} and {len(self.long_factor)}"
            )
        if factor is None:
            factor = max_position_embeddings / original_max_position_embeddings
        if attention_factor is None:
            attention_factor = (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max_position_embeddings))
            )
        self.attention_scaling = float(attention_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)

    def num_cached_positions(self) -> int:
        return self.original_max_position_embeddings + self.max_position_embeddings

    def compute_inv_freq(self, long: bool = False) -> Tensor:
        ext_factors = torch.tensor(self.long_factor if long else self.short_factor, dtype=torch.float32)
        return 1.0 / (
            ext_factors
            * self.base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim)
        )

    def init_buffers(self, device: torch.device | str) -> None:
        device = torch.device(device)
        with torch.device("cpu"):
            short, long = self.compute_inv_freq(), self.compute_inv_freq(long=True)
        cache = torch.cat(
            (
                self._cos_sin(short, self.original_max_position_embeddings, device),
                self._cos_sin(long, self.max_position_embeddings, device),
            )
        )
        self.cos_sin_cache = cache.to(self.dtype)

    def table_positions(self, positions: Tensor) -> Tensor:
        original = self.original_max_position_embeddings
        return positions + (positions >= original).any() * original  # the long rows; a tensor op: no host sync


ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional")


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    is_neox_style: bool = True,
    dtype: torch.dtype = torch.float32,
) -> RotaryEmbedding:
    """The rotary embedding for a model config.

    ``rope_scaling`` is the config's ``rope_scaling`` (or transformers 5's ``rope_parameters``):
    the type under ``rope_type`` (or legacy ``type``) and its keys ``factor``,
    ``original_max_position_embeddings`` (default ``max_position``), ``low_freq_factor``,
    ``high_freq_factor``, ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``,
    ``attention_factor``, ``truncate``, ``short_factor``, ``long_factor``; other keys
    (``rope_theta``, ``partial_rotary_factor``) are ignored, since ``base`` and ``rotary_dim``
    are passed explicitly.

    Calls with equal arguments (and the same default device, target device of
    :func:`framework.kernels.kernels_for`, plugin set and ``FW_KERNELS``) return the same module, as in vLLM,
    so all layers of a model share one table (a 128k-position table is 64 MiB in float32).
    Models built in one process for the same device share it too; since the table is
    recomputed whenever the module moves, that is safe while they live on that device.
    """
    scaling = dict(rope_scaling or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling = {} if rope_type == "default" else scaling
    frozen = tuple(
        sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items() if k not in _IGNORED_KEYS)
    )
    device = f"{torch.empty(0).device}:{kernels.target_device()}"  # the device context and the model's device
    # a module holds the kernels chosen when it was built: by the plugin set and by FW_KERNELS
    kernel_choice = (plugins.generation(), os.environ.get("FW_KERNELS", ""))
    return _cached_rope(
        head_size, rotary_dim, max_position, base, rope_type, frozen, is_neox_style, dtype, device, kernel_choice
    )


_IGNORED_KEYS = ("type", "rope_theta", "partial_rotary_factor")


@functools.cache
def _cached_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_type: str,
    frozen_scaling: tuple,
    is_neox_style: bool,
    dtype: torch.dtype,
    device: str,
    kernel_choice: tuple,
) -> RotaryEmbedding:
    scaling = dict(frozen_scaling)
    args = (head_size, rotary_dim, max_position, base, is_neox_style, dtype)

    def need(key: str) -> Any:
        if scaling.get(key) is None:
            raise ValueError(f"rope type {rope_type!r} needs {key!r} in rope_scaling; got {sorted(scaling)}")
        return scaling[key]

    original = scaling.get("original_max_position_embeddings") or max_position
    if rope_type == "default":
        return RotaryEmbedding(*args)
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(*args, factor=need("factor"))
    if rope_type == "dynamic":
        return DynamicNTKScalingRotaryEmbedding(*args, factor=need("factor"))
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(
            *args,
            factor=need("factor"),
            low_freq_factor=need("low_freq_factor"),
            high_freq_factor=need("high_freq_factor"),
            original_max_position_embeddings=original,
        )
    if rope_type == "yarn":
        return YaRNScalingRotaryEmbedding(
            *args,
            factor=scaling.get("factor") or max_position / original,
            original_max_position_embeddings=original,
            beta_fast=scaling.get("beta_fast") or 32,
            beta_slow=scaling.get("beta_slow") or 1,
            mscale=scaling.get("mscale"),
            mscale_all_dim=scaling.get("mscale_all_dim"),
            attention_factor=scaling.get("attention_factor"),
            truncate=scaling.get("truncate", True),
        )
    if rope_type == "longrope":
        return LongRopeScaledRotaryEmbedding(
            *args,
            original_max_position_embeddings=original,
            short_factor=need("short_factor"),
            long_factor=need("long_factor"),
            factor=scaling.get("factor"),
            attention_factor=scaling.get("attention_factor"),
        )
    if rope_type == "proportional":  # rotary_dim: the features that rotate; the table spans the head
        return ProportionalRotaryEmbedding(
            head_size, rotary_dim, max_position, base, is_neox_style, dtype, factor=scaling.get("factor") or 1.0
        )
    raise ValueError(f"unknown rope type {rope_type!r}; valid: {', '.join(ROPE_TYPES)}")
