"""llama3 RoPE scaling recovered from llama.cpp's ``rope_freqs`` factors (``fw_gguf.rope_freqs``).

The factors are computed here as llama.cpp's converter computes them (``LlamaModel``'s
``generate_extra_tensors``) and stored in float32, as a file holds them.
"""

from __future__ import annotations

import math

import pytest
from fw_gguf.rope_freqs import llama3_factors, llama3_scaling_from_factors


def converter_factors(factor, low, high, length, base, dim) -> list[float]:
    """llama.cpp's ``rope_freqs`` for a llama3 scaling, rounded to float32."""
    import numpy as np

    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / dim))
        if wavelen < length / high:
            out.append(1.0)
        elif wavelen > length / low:
            out.append(factor)
        else:
            smooth = (length / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32).astype(float).tolist()


def test_llama_3_1_scaling_is_recovered_exactly():
    factors = converter_factors(8.0, 1.0, 4.0, 8192, 500000.0, 128)
    assert llama3_scaling_from_factors(factors, 500000.0, 128) == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192.0,
    }


def test_another_low_factor_gives_a_scaling_with_the_same_factors():
    """low 2 / high 6 over 16384: recovered with low 1 (its own high and length), the same factors."""
    factors = converter_factors(32.0, 2.0, 6.0, 16384, 10000.0, 64)
    scaling = llama3_scaling_from_factors(factors, 10000.0, 64)
    assert scaling["low_freq_factor"] == 1.0 and scaling["factor"] == 32.0
    assert llama3_factors(scaling, 10000.0, 64) == pytest.approx(factors, rel=1e-5)


def test_scout_scaling_without_a_ramp():
    factors = converter_factors(16.0, 1.0, 1.0, 8192, 500000.0, 128)
    scaling = llama3_scaling_from_factors(factors, 500000.0, 128)
    assert scaling["low_freq_factor"] == scaling["high_freq_factor"] == 1.0
    assert llama3_factors(scaling, 500000.0, 128) == factors


def test_unscaled_and_foreign_factors():
    assert llama3_scaling_from_factors([1.0] * 64, 500000.0, 128) is None
    with pytest.raises(ValueError, match="llama3 RoPE scaling"):
        llama3_scaling_from_factors([1.0, 4.0, 2.0, 8.0], 10000.0, 8)
    with pytest.raises(ValueError, match="need 64"):
        llama3_scaling_from_factors([1.0, 8.0], 500000.0, 128)
