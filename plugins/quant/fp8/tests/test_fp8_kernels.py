"""The FP8 Triton kernels under the Triton interpreter against dequantize-then-matmul of the same
layout (fp32 activations: the interpreter computes bf16 wrongly): the W8A16 GEMV and tile forms
with block scales (per 128-row block and per output feature), channel scales, split-K; the
per-token-group activation quantizer against its torch reference; the W8A8 block GEMM against the
float32 product of the quantized activations and weights; and the main variants compiled for sm_90."""

from __future__ import annotations

import pytest
import torch
from fp8_reference import quantize_reference, random_weight

from framework.testing import HopperCompile, compile_for_hopper, interpreted, require_triton

require_triton()

from fw_fp8.kernels.layout import Fp8Weight, collapse_row_scales, dequantize_fp8_weight  # noqa: E402
from fw_fp8.kernels.w8a8_block import choose_config as w8a8_config  # noqa: E402
from fw_fp8.kernels.w8a8_block import (  # noqa: E402
    quantize_activations,
    quantize_activations_reference,
    w8a8_block_matmul,
)
from fw_fp8.kernels.w8a16 import choose_config, w8a16_matmul  # noqa: E402


def fp8_weight(n: int, k: int, granularity: str, per_feature_rows: bool = False, seed: int = 0) -> Fp8Weight:
    q, scale = quantize_reference(random_weight(n, k, torch.Generator().manual_seed(seed)), granularity)
    if granularity == "block":
        if per_feature_rows:
            return Fp8Weight(q, scale.repeat_interleave(128, 0)[:n].contiguous(), 1, 128)
        return Fp8Weight(q, scale, 128, 128)
    return Fp8Weight(q, scale.reshape(-1, 1).expand(n, 1).contiguous(), 1, k)


CASES = [  # (n, k, granularity, per-feature scale rows, rows)
    (96, 256, "block", False, 1),
    (160, 384, "block", True, 3),
    (64, 320, "block", False, 8),
    (128, 256, "channel", False, 2),
    (96, 256, "tensor", False, 1),
    (192, 256, "block", False, 16),
    (192, 256, "block", False, 17),
    (80, 384, "channel", False, 33),
]


@interpreted
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[0]}-k{c[1]}-{c[2]}{'-rows1' if c[3] else ''}-m{c[4]}")
def test_w8a16_equals_dequantize_then_matmul(case):
    n, k, granularity, per_feature, rows = case
    weight = fp8_weight(n, k, granularity, per_feature, seed=n + k)
    w = dequantize_fp8_weight(weight, torch.float32)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(w8a16_matmul(x, weight), x @ w.t(), rtol=1e-4, atol=1e-4)
    rule = choose_config(rows, n, k, 128)
    for forced in (
        {**rule, "BLOCK_K": 128, "SUB_K": 128, "SPLIT_K": 2},  # split-K partial sums
        {**rule, "BLOCK_K": 256, "SUB_K": 128, "SPLIT_K": 1},
    ):  # two scale columns a step
        torch.testing.assert_close(w8a16_matmul(x, weight, config=forced), x @ w.t(), rtol=1e-4, atol=1e-4)


def test_per_feature_block_rows_fold_back_into_blocks_only_when_exact():
    weight = fp8_weight(256, 128, "block")
    expanded = weight.scale.repeat_interleave(128, 0)
    folded, rows = collapse_row_scales(expanded, 128)
    assert rows == 128 and torch.equal(folded, weight.scale)
    shifted = torch.cat([expanded[64:], expanded[:64]])  # blocks that start 64 rows in
    assert collapse_row_scales(shifted, 128)[1] == 1
    assert collapse_row_scales(expanded[:192], 128)[1] == 1


@pytest.mark.gpu  # the interpreter mis-rounds float -> FP8 (0.49 -> 0.25): the CPU uses the reference itself
@pytest.mark.parametrize("shape", [(3, 256), (5, 200)])
def test_activation_groups_quantize_as_the_torch_reference(shape):
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * torch.logspace(-2, 1, shape[1])).cuda()
    q, s = quantize_activations(x)
    q_ref, s_ref = quantize_activations_reference(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), q_ref.float())
    groups = s_ref.repeat_interleave(128, 1)[:, : shape[1]]
    torch.testing.assert_close(q.float() * groups, x, rtol=0.07, atol=1e-6)  # E4M3: 3 mantissa bits


@interpreted
@pytest.mark.parametrize(
    ("n", "k", "granularity", "rows"), [(96, 256, "block", 16), (160, 320, "block", 40), (128, 256, "channel", 20)]
)
def test_w8a8_block_gemm_equals_the_product_of_quantized_operands(n, k, granularity, rows):
    weight = fp8_weight(n, k, granularity, seed=k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2))
    q, s = quantize_activations_reference(x)
    x_values = q.float() * s.repeat_interleave(128, 1)[:, :k]
    expected = x_values @ dequantize_fp8_weight(weight, torch.float32).t()
    config = {**w8a8_config(rows, n, k), "FUSED_QUANT": False}  # the torch quantizer: exact on the CPU
    torch.testing.assert_close(w8a8_block_matmul(x, weight, config=config), expected, rtol=1e-4, atol=1e-4)


def _hopper_w8a16(block_m: int, block_n: int, block_k: int, scale_rows: int, stages: int) -> HopperCompile:
    return HopperCompile(
        "fw_fp8.kernels.w8a16:w8a16_matmul_kernel",
        {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "out_ptr": "*bf16"},
        {
            "SCALE_ROWS": scale_rows,
            "SCALE_COLS": 128,
            "FP32": False,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_K": block_k,
            "SUB_K": 128,
        },
        options={"num_warps": 4, "num_stages": stages},
        divisible_by_16=("x_ptr", "w_ptr", "scale_ptr", "out_ptr", "N", "K", "stride_xm", "stride_om", "k_per_split"),
    )


@pytest.mark.slow
def test_main_kernel_variants_compile_for_sm90():  # the W8A8 block GEMM's variants: test_fp8_gemv.py
    ptx = compile_for_hopper([_hopper_w8a16(16, 64, 512, 128, 4), _hopper_w8a16(64, 128, 128, 1, 3)])
    assert len(ptx) == 2
    for w8a16 in ptx:  # wgmma with the upcast weight as its register operand, fed by 16-byte async copies
        assert "wgmma" in w8a16 and "cp.async.cg.shared.global" in w8a16 and "ld.global.b8" not in w8a16
