"""The one-row integer GEMV (``fw_gptq.kernels.gemv_int8``) under the Triton interpreter against the
dequantized kernel-layout weights times x rounded to int8 per 32 inputs (its torch reference), for
4 and 8 bits, zero points, groups of 32 .. channel-wise, split-K and ragged N; plus sm_90 compiles."""

from __future__ import annotations

import pytest
import torch
from test_gptq_kernels import kernel_weight

from framework.testing import HopperCompile, compile_for_hopper, interpreted, require_triton

require_triton()

from fw_gptq.kernels.gemv_int8 import int8_gemv, int8_gemv_supported, quantize_x_reference  # noqa: E402
from fw_gptq.kernels.layout import dequantize_kernel_weight  # noqa: E402

CASES = [  # (n, k, bits, group, symmetric)
    (96, 256, 4, 128, True),
    (160, 512, 4, 32, False),
    (72, 512, 8, 64, False),
    (128, 512, 4, -1, True),
    (64, 256, 8, 128, True),
]


@interpreted
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[0]}-k{c[1]}-{c[2]}bit-g{c[3]}-{'sym' if c[4] else 'asym'}")
def test_int8_gemv_equals_the_rounded_activations_times_the_dequantized_weight(case):
    n, k, bits, group, symmetric = case
    weight, _ = kernel_weight(n, k, bits, group, symmetric, act_order=False, seed=n + k + bits)
    assert int8_gemv_supported(weight)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3))
    expected = quantize_x_reference(x) @ dequantize_kernel_weight(weight, torch.float32).t()
    scale = expected.abs().max()
    for block_n, split_k in ((None, None), (32, 2), (64, 4)):
        got = int8_gemv(x, weight, block_n=block_n, split_k=split_k)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(scale))
    # the rounding is real: against x itself the error is that of 8-bit activations, not zero
    exact = x @ dequantize_kernel_weight(weight, torch.float32).t()
    assert 0 < (got - exact).abs().max() < 0.05 * float(exact.abs().max())


def test_act_order_groups_out_of_order_are_not_taken():
    weight, _ = kernel_weight(64, 256, 4, 32, True, act_order=True, seed=5, local_g_idx=True)
    assert weight.g_idx is not None and not int8_gemv_supported(weight)


def _hopper_case(bits, has_zeros, split):
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
            "GROUP_SIZE": 128,
            "HAS_ZEROS": has_zeros,
            "STEP": 128,
            "BLOCK_N": 64,
            "SPLIT": split,
            "EMULATE": False,
        },
        options={"num_warps": 4},
        divisible_by_16=("x_ptr", "qweight_ptr", "scales_ptr", "zeros_ptr", "out_ptr", "partial_ptr", "N", "K"),
    )


def test_int8_gemv_compiles_for_sm90_with_dp4a():
    ptx = compile_for_hopper([_hopper_case(4, False, False), _hopper_case(4, True, True), _hopper_case(8, False, True)])
    assert all("dp4a.u32.s32" in p for p in ptx)
    assert all("ld.global.v4" in p or "ld.global.nc.v4" in p for p in ptx)  # 16-byte weight loads
