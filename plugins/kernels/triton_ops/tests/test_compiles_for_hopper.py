"""The day-5 kernels of this plugin lower to sm_90 PTX and pass ``ptxas`` (no GPU needed): the
GEMV in each form the rule picks, its split sum, and both L2 prefetches, whose instructions must
survive into the PTX (a prefetch the compiler drops would be a silent no-op)."""

from __future__ import annotations

import importlib.util

import pytest

from framework.testing import HopperCompile, compile_for_hopper

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

GEMV = "fw_triton_ops.gemv:_gemv_kernel"
GEMV_POINTERS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16"}


def test_gemv_split_sum_and_prefetch_kernels_compile_for_hopper():
    cases = [
        HopperCompile(GEMV, {**GEMV_POINTERS, "out_ptr": "*bf16"},
                      dict(HAS_BIAS=True, M_PAD=1, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1), options=dict(num_warps=8)),
        HopperCompile(GEMV, {**GEMV_POINTERS, "out_ptr": "*fp32"},
                      dict(HAS_BIAS=False, M_PAD=1, BLOCK_N=32, BLOCK_K=128, SPLIT_K=4), options=dict(num_warps=8)),
        HopperCompile(GEMV, {**GEMV_POINTERS, "out_ptr": "*bf16"},
                      dict(HAS_BIAS=False, M_PAD=16, BLOCK_N=128, BLOCK_K=256, SPLIT_K=1), options=dict(num_warps=4)),
        HopperCompile("fw_triton_ops.gemv:_sum_splits_kernel",
                      {"partial_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16"},
                      dict(HAS_BIAS=True, SPLIT_K=4, BLOCK=1024), options=dict(num_warps=4)),
        HopperCompile("fw_triton_ops.prefetch:_bulk_prefetch_kernel", {"x_ptr": "*u8", "sink_ptr": "*fp32"},
                      dict(CHUNK=16384, LANES=32), int64_args=("num_bytes",), options=dict(num_warps=1)),
        HopperCompile("fw_triton_ops.prefetch:_load_to_l2_kernel", {"x_ptr": "*bf16", "sink_ptr": "*fp32"},
                      dict(BLOCK=2048), options=dict(num_warps=8)),
    ]
    ptx = compile_for_hopper(cases)
    assert all(".target sm_90" in text for text in ptx)
    assert "mma" in ptx[2] or "wgmma" in ptx[2]  # the 16-row form multiplies on tensor cores
    assert ptx[4].count("cp.async.bulk.prefetch.L2.global") == 1
    assert "evict_last" in ptx[5]
