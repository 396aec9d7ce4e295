"""The one-row integer GEMV (``fw_gptq.kernels.gemv_int8``) under the Triton interpreter against the
dequantized kernel-layout weights times x rounded to int8 per 32 inputs (its torch reference), for
4 and 8 bits, zero points, groups of 32 .. channel-wise, act-order, split-K and ragged N; the
row-contiguous layout against the independent GPTQ packer; the dispatch switch; and sm_90 compiles
of every launch setting the rule gives at the Llama-3-8B shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference_formats import _pack_rows, random_int_weight
from test_gptq_kernels import kernel_weight

from framework.testing import HopperCompile, compile_for_hopper, interpreted, require_triton

require_triton()

from fw_gptq.kernels import wna16  # noqa: E402
from fw_gptq.kernels.gemv_int8 import (  # noqa: E402
    GemvConfig,
    gemv_config,
    int8_gemv,
    int8_gemv_supported,
    quantize_x_reference,
)
from fw_gptq.kernels.layout import dequantize_kernel_weight, to_kernel_layout  # noqa: E402
from fw_gptq.packing import IntWeight  # noqa: E402

CASES = [  # (n, k, bits, group, symmetric, act_order)
    (96, 256, 4, 128, True, False),
    (160, 512, 4, 32, False, False),
    (72, 512, 8, 64, False, False),
    (128, 512, 4, -1, True, False),
    (64, 256, 8, 128, True, False),
    (80, 256, 4, 64, False, True),
]


def _case_id(c):
    return f"n{c[0]}-k{c[1]}-{c[2]}bit-g{c[3]}-{'sym' if c[4] else 'asym'}{'-act' if c[5] else ''}"


@interpreted
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_int8_gemv_equals_the_rounded_activations_times_the_dequantized_weight(case):
    n, k, bits, group, symmetric, act_order = case
    weight, _ = kernel_weight(n, k, bits, group, symmetric, act_order, seed=n + k + bits)
    assert int8_gemv_supported(weight) and (weight.perm is not None) == act_order
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3))
    if weight.perm is not None:  # the kernel takes x in its sorted input order, as wna16_matmul gives it
        x = x.index_select(1, weight.perm)
    dense = dequantize_kernel_weight(weight, torch.float32, permuted=True)
    expected = quantize_x_reference(x) @ dense.t()
    scale = float(expected.abs().max())
    settings = [None, GemvConfig(32, 64, 2), GemvConfig(16, 32, 4), GemvConfig(64, 128, 8)]  # 8 > steps: capped
    for config in settings:
        got = int8_gemv(x, weight, config=config)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)
    # the rounding is real: against x itself the error is that of 8-bit activations, not zero
    exact = x @ dense.t()
    assert 0 < (got - exact).abs().max() < 0.05 * float(exact.abs().max())


@interpreted
def test_one_row_dispatch_follows_the_switch(monkeypatch):
    weight, w = kernel_weight(64, 256, 4, 64, False, False, seed=9)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4))
    assert wna16.DEFAULT_GEMV in wna16.GEMV_CHOICES
    for choice in wna16.GEMV_CHOICES:
        monkeypatch.setenv("FW_GPTQ_GEMV", choice)
        assert wna16.gemv_choice() == choice
        assert not wna16.int8_gemv_chosen(weight, x)  # on CUDA only: the CPU keeps the exact kernel
    torch.testing.assert_close(wna16.wna16_matmul(x, weight), x @ w.t(), rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("FW_GPTQ_GEMV", "fast")
    with pytest.raises(ValueError, match="int8, tile"):
        wna16.gemv_choice()


def test_unsupported_weights_are_refused_with_the_reason():
    local, _ = kernel_weight(64, 256, 4, 32, True, act_order=True, seed=5, local_g_idx=True)
    assert local.g_idx is not None and not int8_gemv_supported(local)
    with pytest.raises(ValueError, match="g_idx set"):
        int8_gemv(torch.zeros(1, 128), local)
    small_groups, _ = kernel_weight(64, 256, 4, 16, True, act_order=False, seed=5)
    assert not int8_gemv_supported(small_groups)


def test_row_contiguous_layout_is_the_gptq_packing_of_each_row():
    """Row n of ``qweight`` is AutoGPTQ's packing (independent numpy loops) of column n of ``q``."""
    for bits in (4, 8):
        q, scales, zeros, g_idx, _ = random_int_weight(
            48, 128, bits, 32, False, False, torch.Generator().manual_seed(2)
        )
        weight = to_kernel_layout(
            IntWeight(q.to(torch.uint8), scales, zeros.to(torch.uint8), None, bits, 32), torch.float32
        )
        reference = _pack_rows(q.numpy(), bits)  # [K / pf, N]: word r of column n holds inputs r * pf + j
        assert weight.qweight.shape == (48, 128 * bits // 32) and weight.qweight.stride(1) == 1
        np.testing.assert_array_equal(weight.qweight.numpy(), reference.T)


def _hopper_case(bits, has_zeros, config, group=128):
    return HopperCompile(
        "fw_gptq.kernels.gemv_int8:_int8_gemv_kernel",
        {
            "x_ptr": "*bf16",
            "qweight_ptr": "*i32",
            "scales_ptr": "*bf16",
            "zeros_ptr": "*bf16",
            "out_ptr": "*bf16",
            "partial_ptr": "*fp32",
            "counter_ptr": "*i32",
        },
        {
            "BITS": bits,
            "GROUP_SIZE": group,
            "HAS_ZEROS": has_zeros,
            "STEP": config.step,
            "BLOCK_N": config.block_n,
            "SPLIT": config.split_k > 1,
            "EMULATE": False,
        },
        options={"num_warps": config.num_warps, "num_stages": config.num_stages},
        divisible_by_16=(
            "x_ptr",
            "qweight_ptr",
            "scales_ptr",
            "zeros_ptr",
            "out_ptr",
            "partial_ptr",
            "N",
            "K",
            "stride_qn",
        ),
    )


LLAMA3_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "head": (128256, 4096),
}


@pytest.mark.slow
def test_int8_gemv_compiles_for_sm90_with_dp4a_at_every_rule_setting():
    cases = sorted(
        {
            (bits, zeros, gemv_config(n, k, bits, 132))
            for bits in (4, 8)
            for zeros in (False, True)
            for n, k in LLAMA3_8B.values()
        }
    )
    assert {c[2].split_k for c in cases} > {1}  # the split form is among them
    ptx = compile_for_hopper([_hopper_case(*c) for c in cases] + [_hopper_case(4, True, GemvConfig(32, 256, 4), 32)])
    assert all("dp4a.u32.s32" in p for p in ptx)
    assert all("ld.global.v4" in p or "ld.global.nc.v4" in p for p in ptx)  # 16-byte weight loads
