"""Every FP8 layout through framework.testing's conformance kits (every linear layer kind incl.
fused q|k|v with 64-row k/v shards, a 96-row weight, TP 1/4 slices that do not start on 128-row
blocks; FusedMoE) against the values the test's own writer encoded: the CPU's torch path, and
the W8A16 Triton kernel under the interpreter."""

from __future__ import annotations

import pytest
import torch
from fp8_schemes import SCHEMES, Fp8FormatScheme

from framework.testing import check_linear_method, check_moe_method


@pytest.mark.parametrize("scheme", SCHEMES, ids=repr)
def test_linear_method_passes_the_conformance_kit(scheme, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch path (dequantize, then matmul)
    cases = check_linear_method(scheme, num_rows=(1, 7), tp_sizes=(1, 4), dtypes=(torch.bfloat16,))
    assert "qkv_proj tp=4 rank=3 bfloat16" in cases


def test_linear_method_through_the_w8a16_kernel_passes_the_conformance_kit(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cases = check_linear_method(Fp8FormatScheme("block"), num_rows=(1, 12), tp_sizes=(2,), dtypes=(torch.float16,))
    assert "qkv_proj tp=2 rank=1 float16" in cases


@pytest.mark.parametrize("scheme", SCHEMES, ids=repr)
def test_experts_equal_dequantize_then_moe(scheme, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cases = check_moe_method(scheme, num_experts=8, num_tokens=(1, 4, 40), tp_sizes=(1, 2), dtypes=(torch.bfloat16,))
    assert "experts tp=2 rank=1 bfloat16" in cases
