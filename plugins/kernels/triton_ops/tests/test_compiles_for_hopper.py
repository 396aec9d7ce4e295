"""This plugin's newest kernels lower to sm_90 PTX and pass ``ptxas`` (no GPU needed): the GEMV in
each form its table and rule pick, its split sum, and the rotary kernel with the QK norm in both
rotary styles."""

from __future__ import annotations

import pytest

from framework.testing import HopperCompile, compile_for_hopper, require_triton

require_triton()

GEMV = "fw_triton_ops.gemv:_gemv_kernel"
GEMV_POINTERS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16"}


def test_gemv_and_split_sum_kernels_compile_for_hopper():
    cases = [
        HopperCompile(
            GEMV,
            {**GEMV_POINTERS, "out_ptr": "*bf16"},
            dict(HAS_BIAS=True, M_PAD=1, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1),
            options=dict(num_warps=8, num_stages=4),
        ),
        HopperCompile(
            GEMV,
            {**GEMV_POINTERS, "out_ptr": "*fp32"},
            dict(HAS_BIAS=False, M_PAD=1, BLOCK_N=32, BLOCK_K=128, SPLIT_K=4),
            options=dict(num_warps=8, num_stages=4),
        ),
        HopperCompile(
            GEMV,
            {**GEMV_POINTERS, "out_ptr": "*bf16"},
            dict(HAS_BIAS=False, M_PAD=16, BLOCK_N=128, BLOCK_K=256, SPLIT_K=1),
            options=dict(num_warps=4, num_stages=4),
        ),
        HopperCompile(
            "fw_triton_ops.gemv:_sum_splits_kernel",
            {"partial_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16"},
            dict(HAS_BIAS=True, SPLIT_K=4, BLOCK=1024),
            options=dict(num_warps=4),
        ),
        HopperCompile(
            GEMV,
            {**GEMV_POINTERS, "out_ptr": "*fp32"},  # one row on tensor cores, K split (the table's)
            dict(HAS_BIAS=False, M_PAD=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=4),
            options=dict(num_warps=4, num_stages=4),
        ),
    ]
    ptx = compile_for_hopper(cases)
    assert all(".target sm_90" in text for text in ptx)
    for form in (2, 4):  # rows padded to 16 multiply on tensor cores
        assert "mma" in ptx[form] or "wgmma" in ptx[form]


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_qk_norm_rotary_kernel_compiles_for_hopper(is_neox):
    pointers = {name: "*bf16" for name in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr", "q_w_ptr", "k_w_ptr")}
    pointers.update(positions_ptr="*i64", cache_ptr="*fp32")
    constexprs = dict(HEAD_SIZE=128, ROTARY_DIM=128, IS_NEOX=is_neox, BLOCK_H=4, BLOCK_HALF=64, BLOCK_PASS=1)
    cases = [
        HopperCompile(
            "fw_triton_ops.rotary:_rotary_kernel",
            pointers,
            {**constexprs, **norm},
            float_args=("eps", "offset"),
            options=dict(num_warps=4),
        )
        for norm in (
            dict(HAS_NORM=True, HAS_OFFSET=False),
            dict(HAS_NORM=True, HAS_OFFSET=True),
            dict(HAS_NORM=False, HAS_OFFSET=False),
        )
    ]
    with_norm, with_offset, plain = compile_for_hopper(cases)
    assert "rsqrt" in with_norm and "rsqrt" in with_offset and "rsqrt" not in plain
