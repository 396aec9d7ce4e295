"""The MXFP4 MoE kernels lower to sm_90 PTX and pass ``ptxas`` (no GPU needed), in the decode and
prefill tile configurations, plain SwiGLU and gpt-oss's biased clamped SwiGLU, with tensor-core dots."""

from __future__ import annotations

import pytest

from framework.testing import HopperCompile, compile_for_hopper, require_triton

require_triton()

from fw_triton_ops.fused_moe import launch_config  # noqa: E402

SHARED = {"sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32"}


@pytest.mark.parametrize("num_pairs", [4, 512], ids=["decode", "prefill"])
def test_mxfp4_moe_kernels_compile_for_hopper(num_pairs):
    config = launch_config(num_pairs)
    options = dict(num_warps=config.pop("num_warps"), num_stages=config.pop("num_stages"))
    meta = dict(**config, CAST_FP32=False, PRECISION="tf32")
    gate_up = {
        "x_ptr": "*bf16",
        "gate_ptr": "*u8",
        "up_ptr": "*u8",
        "gate_s_ptr": "*u8",
        "up_s_ptr": "*u8",
        "bias_ptr": "*bf16",
        "act_ptr": "*bf16",
        **SHARED,
    }
    down = {
        "act_ptr": "*bf16",
        "w_ptr": "*u8",
        "s_ptr": "*u8",
        "bias_ptr": "*bf16",
        "out_ptr": "*bf16",
        "weights_ptr": "*fp32",
        **SHARED,
    }
    cases = [
        HopperCompile(
            "fw_fp4.kernels.mxfp4_moe:_mxfp4_gate_up_kernel",
            gate_up,
            {**meta, "HAS_BIAS": gpt_oss, "SWIGLU_OAI": gpt_oss},
            float_args=("swiglu_alpha", "swiglu_limit"),
            options=options,
        )
        for gpt_oss in (True, False)
    ] + [
        HopperCompile("fw_fp4.kernels.mxfp4_moe:_mxfp4_down_kernel", down, {**meta, "HAS_BIAS": True}, options=options)
    ]
    ptx = compile_for_hopper(cases)
    assert all(".target sm_90" in text for text in ptx)
    assert all("mma" in text for text in ptx)  # the dots run on tensor cores
