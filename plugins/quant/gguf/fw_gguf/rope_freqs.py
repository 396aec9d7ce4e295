"""Llama 3 style RoPE scaling from llama.cpp's ``rope_freqs`` tensor.

llama.cpp's converter does not store a `llama3` ``rope_scaling`` as metadata: it writes one
factor per rotary pair (``rope_freqs.weight``, by which llama.cpp divides the pair's frequency),
computed from ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
``original_max_position_embeddings`` (``L``) as transformers computes the frequencies::

    wavelength w < L / high      -> 1                      (high frequencies kept)
    w > L / low                  -> factor                 (low frequencies divided)
    otherwise                    -> 1 / ((1 - s) / factor + s),   s = (L / w - low) / (high - low)

The factors fix ``factor`` (their largest) and, on the ramp, ``s = A / w - B`` with
``A = L / (high - low)`` and ``B = low / (high - low)``; every ``(L, low, high)`` with the same
``A`` and ``B`` gives the same factors (and the same wavelength bounds), so ``low = 1`` is taken
and ``A``, ``B`` fitted from two or more ramp factors. Without ramp factors (Llama 4 Scout:
``low == high``) ``low = high = 1`` and ``L`` lies between the last kept and the first divided
wavelength. The rebuilt scaling is checked against the tensor before it is used.
"""

from __future__ import annotations

import math
from typing import Any


def _wavelengths(base: float, rotary_dim: int) -> list[float]:
    return [2 * math.pi * base ** (2 * i / rotary_dim) for i in range(rotary_dim // 2)]


def llama3_factors(scaling: dict[str, Any], base: float, rotary_dim: int) -> list[float]:
    """The ``rope_freqs`` values llama.cpp's converter writes for a `llama3` ``scaling``."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    length = scaling["original_max_position_embeddings"]
    factors = []
    for w in _wavelengths(base, rotary_dim):
        if w < length / high:
            factors.append(1.0)
        elif w > length / low:
            factors.append(factor)
        else:
            smooth = (length / w - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def _nice(value: float) -> float:
    """``value`` rounded to an integer when float32 storage is all that separates them."""
    return float(round(value)) if abs(value - round(value)) < 1e-3 * max(1.0, abs(value)) else value


def llama3_scaling_from_factors(factors: list[float], base: float, rotary_dim: int) -> dict[str, Any] | None:
    """The `llama3` ``rope_scaling`` whose ``rope_freqs`` are ``factors`` (one per rotary pair of
    ``rotary_dim`` dimensions, RoPE base ``base``); None when every factor is 1 (no scaling).
    Raises ``ValueError`` when no `llama3` scaling gives these factors."""
    if len(factors) != rotary_dim // 2:
        raise ValueError(
            f"rope_freqs has {len(factors)} factors; {rotary_dim} rotary dimensions need {rotary_dim // 2}"
        )
    factor = max(factors)
    if factor == 1.0:
        return None
    waves = _wavelengths(base, rotary_dim)
    kept = [w for w, f in zip(waves, factors, strict=True) if f == 1.0]
    divided = [w for w, f in zip(waves, factors, strict=True) if f == factor]
    ramp = [(w, f) for w, f in zip(waves, factors, strict=True) if f not in (1.0, factor)]
    if len(ramp) >= 2:  # least squares for s = A / w - B over the ramp
        xs = [1 / w for w, _ in ramp]
        ys = [(1 / f - 1 / factor) / (1 - 1 / factor) for _, f in ramp]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mean_x) ** 2 for x in xs
        )
        offset = slope * mean_x - mean_y  # B
        if offset <= 0:
            raise ValueError("rope_freqs ramps the wrong way for llama3 RoPE scaling")
        low, high, length = 1.0, _nice(1 + 1 / offset), _nice(slope / offset)
    elif not ramp:
        low = high = 1.0
        upper = min(divided) if divided else max(waves) * 2
        lower = max(kept) if kept else min(waves) / 2
        length = round(math.sqrt(lower * upper))  # any length strictly between the two gives these factors
    else:
        raise ValueError("rope_freqs has a single ramp factor: its llama3 RoPE scaling cannot be recovered")
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": length,
    }
    rebuilt = llama3_factors(scaling, base, rotary_dim)
    if any(abs(a - b) > 1e-4 * b for a, b in zip(rebuilt, factors, strict=True)):
        raise ValueError(f"rope_freqs {factors} are not llama3 RoPE scaling factors")
    return scaling
