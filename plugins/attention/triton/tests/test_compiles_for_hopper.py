"""The decode kernel lowers to sm_90 PTX and passes ``ptxas`` (no GPU needed) in the forms the
backend launches: with and without storing the new K/V, split or not, with a sliding window."""

from __future__ import annotations

import importlib.util

import pytest

from framework.testing import HopperCompile, compile_for_hopper

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

POINTERS = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
            "seq_lens_ptr": "*i32", "block_table_ptr": "*i32", "new_k_ptr": "*bf16", "new_v_ptr": "*bf16",
            "slot_mapping_ptr": "*i64"}


@pytest.mark.parametrize("store_new_kv", [True, False])
def test_decode_kernel_compiles_for_hopper(store_new_kv):
    cases = [HopperCompile("fw_triton_attention.decode:_decode_attention_kernel", POINTERS,
                           dict(GROUP=group, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128, PAGE=16, IS_SPLIT=split,
                                STORE_NEW_KV=store_new_kv, USE_WINDOW=window, USE_SOFT_CAP=False, FP32=False),
                           float_args=("sm_scale", "soft_cap"), options=dict(num_warps=4, num_stages=2))
             for group, split, window in [(4, False, False), (8, True, False), (8, True, True)]]
    ptx = compile_for_hopper(cases)
    assert all(".target sm_90" in text for text in ptx)
    stores = [text.count("st.global") for text in ptx]
    assert all(count > 0 for count in stores)
