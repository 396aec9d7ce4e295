"""The W4A16/W8A16 Triton core under the Triton interpreter (fp32: the interpreter computes bf16
wrongly) against dequantize-then-matmul of the same kernel layout, for the GEMV and tensor-core
forms, split-K, zero points, act-order (permuted inputs, looked-up groups), 4 and 8 bits; and the
main variants compiled for sm_90 through ptxas."""

from __future__ import annotations

import pytest
import torch
from reference_formats import random_int_weight

from framework.testing import HopperCompile, compile_for_hopper, interpreted, require_triton

require_triton()

from fw_gptq.kernels.layout import dequantize_kernel_weight, to_kernel_layout  # noqa: E402
from fw_gptq.kernels.wna16 import DEQUANT_MIN_ROWS, choose_config, wna16_dequantize, wna16_matmul  # noqa: E402
from fw_gptq.packing import IntWeight  # noqa: E402


def kernel_weight(n, k, bits, group_size, symmetric, act_order, seed, local_g_idx=False):
    generator = torch.Generator().manual_seed(seed)
    q, scales, zeros, g_idx, w = random_int_weight(n, k, bits, group_size, symmetric, act_order, generator)
    if local_g_idx:  # one rank's half of an act-order weight: its groups are not k // group_size
        half = k // 2
        q, g_idx, w = q[:half], g_idx[:half], w[:, :half]
    weight = IntWeight(
        q.to(torch.uint8),
        scales,
        None if zeros is None else zeros.to(torch.uint8),
        g_idx if act_order else None,
        bits,
        k if group_size == -1 else group_size,
    )
    return to_kernel_layout(weight, torch.float32), w


CASES = [  # (n, k, bits, group, symmetric, act_order, rows)
    (96, 256, 4, 128, True, False, 1),
    (160, 256, 4, 32, False, False, 3),
    (64, 512, 8, 64, False, False, 2),
    (128, 256, 4, -1, True, False, 1),
    (96, 256, 4, 32, True, True, 1),
    (64, 256, 4, 128, True, False, 17),
    (80, 256, 8, 32, False, True, 33),
]


@interpreted
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[0]}-k{c[1]}-{c[2]}bit-g{c[3]}-rows{c[6]}")
def test_kernel_equals_dequantize_then_matmul(case):
    n, k, bits, group, symmetric, act_order, rows = case
    weight, w = kernel_weight(n, k, bits, group, symmetric, act_order, seed=n + k)
    torch.testing.assert_close(dequantize_kernel_weight(weight, torch.float32), w)  # the layout round-trips
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(1))
    expected = x @ w.t()
    torch.testing.assert_close(wna16_matmul(x, weight), expected, rtol=1e-4, atol=1e-4)
    rule = choose_config(rows, n, k, weight.group_size)
    sub_k = rule["SUB_K"]
    for forced in (
        {**rule, "BLOCK_K": sub_k, "SPLIT_K": 4},  # split-K partial sums
        {**rule, "BLOCK_K": 2 * sub_k, "SPLIT_K": 1},
    ):  # two slices (two groups) a step
        torch.testing.assert_close(wna16_matmul(x, weight, config=forced), expected, rtol=1e-4, atol=1e-4)


@interpreted
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[6]], ids=["asym-g32", "act-order", "8bit-act-order"])
def test_many_rows_multiply_the_dequantized_weight_with_the_reference_values(case):
    n, k, bits, group, symmetric, act_order, _ = case
    weight, w = kernel_weight(n, k, bits, group, symmetric, act_order, seed=n + k)
    permuted = dequantize_kernel_weight(weight, torch.float32, permuted=True)
    assert torch.equal(wna16_dequantize(weight, torch.float32), permuted)  # bit for bit
    x = torch.randn(DEQUANT_MIN_ROWS + 3, weight.in_features, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(wna16_matmul(x, weight), x @ w.t(), rtol=1e-4, atol=1e-4)


@interpreted
def test_kernel_reads_groups_through_g_idx_when_sorted_groups_are_not_contiguous():
    weight, w = kernel_weight(64, 256, 4, 32, False, True, seed=5, local_g_idx=True)
    assert weight.g_idx is not None and weight.perm is not None  # the lookup path, with permuted inputs
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(wna16_matmul(x, weight), x @ w.t(), rtol=1e-4, atol=1e-4)


@interpreted
def test_kernel_writes_into_a_column_slice_of_a_wider_output():
    weight, w = kernel_weight(64, 128, 4, 64, True, False, seed=3)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(4))
    out = torch.full((2, 160), 7.0)
    wna16_matmul(x, weight, out=out[:, 32:96], config={**choose_config(2, 64, 128, 64), "SPLIT_K": 1})
    torch.testing.assert_close(out[:, 32:96], x @ w.t(), rtol=1e-4, atol=1e-4)
    assert (out[:, :32] == 7).all() and (out[:, 96:] == 7).all()


def _hopper_case(bits, block_m, block_n, block_k, has_zeros, scale_per_slice, has_g_idx=False, stages=4):
    return HopperCompile(
        "fw_gptq.kernels.wna16:wna16_matmul_kernel",
        {
            "x_ptr": "*bf16",
            "qweight_ptr": "*i32",
            "scales_ptr": "*bf16",
            "zeros_ptr": "*bf16",
            "g_idx_ptr": "*i32",
            "out_ptr": "*bf16",
        },
        {
            "BITS": bits,
            "GROUP_SIZE": 128,
            "HAS_ZEROS": has_zeros,
            "HAS_G_IDX": has_g_idx,
            "SCALE_PER_SLICE": scale_per_slice,
            "FP32": False,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_K": block_k,
            "SUB_K": min(block_k, 128),
        },
        options={"num_warps": 4, "num_stages": stages},
        divisible_by_16=(
            "x_ptr",
            "qweight_ptr",
            "scales_ptr",
            "zeros_ptr",
            "out_ptr",
            "N",
            "K",
            "stride_qn",
            "stride_xm",
            "stride_om",
            "k_per_split",
        ),
    )


@pytest.mark.slow
def test_main_kernel_variants_compile_for_sm90():
    ptx = compile_for_hopper(
        [
            _hopper_case(4, 16, 128, 512, False, True),  # decode GEMV, symmetric GPTQ
            _hopper_case(4, 64, 128, 128, True, True, stages=3),  # batch tiles, AWQ / asymmetric
            _hopper_case(8, 16, 128, 128, False, False, has_g_idx=True),  # act-order lookups, 8-bit
        ]
    )
    assert len(ptx) == 3
    rules = [choose_config(1, 28672, 4096, 128, bits=bits) for bits in (4, 8)]  # the decode rule fits an SM
    compile_for_hopper(
        [
            _hopper_case(bits, r["BLOCK_M"], r["BLOCK_N"], r["BLOCK_K"], False, True, stages=r["num_stages"])
            for bits, r in zip((4, 8), rules)
        ]
    )
    assert all("wgmma" in p for p in ptx)  # every form multiplies on Hopper's tensor cores
    assert "cp.async.cg.shared.global" in ptx[0]  # the GEMV streams its words with 16-byte async copies
    # the unpacked weights go straight into the left operand's registers, not through shared memory,
    # and no quarter-rate integer-to-float conversion runs per weight
    assert "st.shared.b16" not in ptx[0] and "st.shared.b16" not in ptx[1]
    assert "cvt.rn.f32.u32" not in ptx[0] and "cvt.rn.f32.s32" not in ptx[0]
