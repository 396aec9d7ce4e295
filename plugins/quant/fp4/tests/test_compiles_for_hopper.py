"""The FP4 MoE kernels lower to sm_90 PTX and pass ``ptxas`` (no GPU needed), in the decode and
prefill tile configurations, for MXFP4 (plain SwiGLU and gpt-oss's biased clamped SwiGLU) and NVFP4
(e4m3 scales per 16 and per-expert global scales), with tensor-core dots. The pointers and the
arguments divisible by 16 are specialized as a launch at the Qwen3-30B-A3B shape (hidden 2048,
768 intermediate features, 128 experts) specializes them."""

from __future__ import annotations

import pytest

from framework.testing import HopperCompile, compile_for_hopper, require_triton

require_triton()

from fw_triton_ops.fused_moe import launch_config  # noqa: E402

SHARED = {"sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32"}


#: Qwen3-30B-A3B's experts: hidden size, intermediate size.
HIDDEN, INTER = 2048, 768
POINTERS = ("x_ptr", "gate_ptr", "up_ptr", "gate_s_ptr", "up_s_ptr", "gate_g_ptr", "up_g_ptr", "bias_ptr", "act_ptr")
DOWN_POINTERS = ("act_ptr", "w_ptr", "s_ptr", "g_ptr", "bias_ptr", "out_ptr", "weights_ptr")


def _divisible(strides: dict[str, int], pointers: tuple[str, ...]) -> tuple[str, ...]:
    """The arguments Triton's launcher marks divisible by 16: every (16-byte aligned) pointer and
    the integer arguments with these values that are multiples of 16."""
    return (*pointers, "sorted_ids_ptr", "block_expert_ptr", *(k for k, v in strides.items() if v % 16 == 0))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_moe_kernels_compile_for_hopper(fmt):
    cases = [case for num_pairs in (8, 512) for case in _cases(fmt, num_pairs)]  # decode, prefill tiles
    ptx = compile_for_hopper(cases)  # one process for all
    assert len(ptx) == len(cases)
    assert all(".target sm_90" in text for text in ptx)
    assert all("mma" in text for text in ptx)  # the dots run on tensor cores


def _cases(fmt: str, num_pairs: int) -> list[HopperCompile]:
    from fw_fp4.kernels.fp4_moe import QUANT_TYPES

    group, e8m0 = QUANT_TYPES[fmt]
    config = launch_config(num_pairs)
    options = dict(num_warps=config.pop("num_warps"), num_stages=config.pop("num_stages"))
    meta = dict(**config, CAST_FP32=False, PRECISION="tf32", GROUP=group, E8M0=e8m0, HAS_GLOBAL=fmt == "nvfp4")
    gate_up = {name: "*u8" for name in POINTERS} | {
        "x_ptr": "*bf16",
        "gate_g_ptr": "*fp32" if fmt == "nvfp4" else "*u8",
        "up_g_ptr": "*fp32" if fmt == "nvfp4" else "*u8",
        "bias_ptr": "*bf16",
        "act_ptr": "*bf16",
        **SHARED,
    }
    down = {name: "*u8" for name in DOWN_POINTERS} | {
        "act_ptr": "*bf16",
        "g_ptr": "*fp32" if fmt == "nvfp4" else "*u8",
        "bias_ptr": "*bf16",
        "out_ptr": "*bf16",
        "weights_ptr": "*fp32",
        **SHARED,
    }
    gate_up_ints = {
        "num_pairs": num_pairs,
        "top_k": 8,
        "HIDDEN": HIDDEN,
        "INTER": INTER,
        "stride_xm": HIDDEN,
        "stride_we": 2 * INTER * HIDDEN // 2,
        "stride_wn": HIDDEN // 2,
        "stride_se": 2 * INTER * HIDDEN // group,
        "stride_sn": HIDDEN // group,
    }
    down_ints = {
        "num_pairs": num_pairs,
        "HIDDEN": HIDDEN,
        "INTER": INTER,
        "stride_we": HIDDEN * INTER // 2,
        "stride_wn": INTER // 2,
        "stride_se": HIDDEN * INTER // group,
        "stride_sn": INTER // group,  # MXFP4: 24, not a multiple of 16
    }
    biased = (True, False) if fmt == "mxfp4" else (False,)
    return [
        HopperCompile(
            "fw_fp4.kernels.fp4_moe:_fp4_gate_up_kernel",
            gate_up,
            {**meta, "HAS_BIAS": gpt_oss, "SWIGLU_OAI": gpt_oss},
            float_args=("swiglu_alpha", "swiglu_limit"),
            options=options,
            divisible_by_16=_divisible(gate_up_ints, POINTERS),
        )
        for gpt_oss in biased
    ] + [
        HopperCompile(
            "fw_fp4.kernels.fp4_moe:_fp4_down_kernel",
            down,
            {**meta, "HAS_BIAS": fmt == "mxfp4"},
            options=options,
            divisible_by_16=_divisible(down_ints, DOWN_POINTERS),
        )
    ]
