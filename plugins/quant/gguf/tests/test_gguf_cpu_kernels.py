"""The packed GGUF CPU kernels (fw_gguf/cpu_kernels.cpp) against gguf-py and torch.

Dequantized values must equal gguf-py's numpy reference bit for bit; products must equal
``x @ dequantized.T`` (torch's BLAS) up to fp32 summation order, for the direct path (few rows,
decode) and the chunked path (many rows, prefill), into column slices of a wider output.
"""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from fw_gguf import cpu
from fw_gguf.cpu import CPU_TYPES, dequantize_cpu, matmul_cpu
from gguf import GGMLQuantizationType as Q

# a machine with a compiler must build the kernels (a failed build fails these tests, it is not skipped)
pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler to build the GGUF CPU kernels"
)

TYPES = sorted(CPU_TYPES)


def _cols(qtype: Q) -> int:
    return 2 * gguf.GGML_QUANT_SIZES[qtype][0] * (2 if gguf.GGML_QUANT_SIZES[qtype][0] == 32 else 1)


def test_the_kernels_build_here():
    assert cpu.kernels_available()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_exact_with_gguf_py(qtype, random_packed):
    packed = random_packed(qtype, rows=37, cols=_cols(qtype), seed=int(qtype))
    expected = torch.from_numpy(gguf.quants.dequantize(packed, qtype).astype(np.float32))
    actual = dequantize_cpu(torch.from_numpy(packed), qtype, 37, _cols(qtype))
    assert torch.equal(actual.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 9, 40], ids=lambda m: f"M{m}")
def test_matmul_equals_torch_on_the_dequantized_weight(qtype, rows, random_packed):
    n, k = 45, 2 * _cols(qtype)
    packed = torch.from_numpy(random_packed(qtype, rows=n, cols=k, seed=10 + int(qtype), scale_exponents=(-3, -1)))
    weight = torch.from_numpy(gguf.quants.dequantize(packed.numpy(), qtype).astype(np.float32))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    wide = torch.full((rows, n + 7), float("nan"))
    matmul_cpu(x, packed, qtype, n, wide[:, 3 : 3 + n])
    expected = x @ weight.T
    torch.testing.assert_close(wide[:, 3 : 3 + n], expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert wide[:, :3].isnan().all() and wide[:, 3 + n :].isnan().all()  # nothing written outside the slice


def test_many_rows_path_dequantizes_in_chunks(monkeypatch, random_packed):
    monkeypatch.setattr(cpu, "CHUNK_ELEMENTS", 256 * 3)  # 3 rows of 256 per chunk: 5 chunks for 13 rows
    packed = torch.from_numpy(random_packed(Q.Q4_K, rows=13, cols=256, seed=5, scale_exponents=(-3, -1)))
    weight = torch.from_numpy(gguf.quants.dequantize(packed.numpy(), Q.Q4_K).astype(np.float32))
    x = torch.randn(cpu.DIRECT_MAX_ROWS + 1, 256)
    out = torch.empty(x.shape[0], 13)
    matmul_cpu(x, packed, Q.Q4_K, 13, out)
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-4)


def test_a_type_without_a_kernel_is_refused_clearly(random_packed):
    packed = torch.from_numpy(random_packed(Q.Q2_K, rows=2, cols=256))
    with pytest.raises(ValueError, match="do not decode Q2_K; they decode .*Q4_K"):
        dequantize_cpu(packed, Q.Q2_K, 2, 256)
