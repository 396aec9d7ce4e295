"""The decode kernel lowers to sm_90 PTX and passes ``ptxas`` (no GPU needed) in the forms the
backend launches: with and without storing the new K/V, split or not, with a sliding window and
chunked local attention."""

from __future__ import annotations

import pytest

from framework.testing import HopperCompile, compile_for_hopper, require_triton

require_triton()

from fw_triton_attention.decode import decode_tiles  # noqa: E402

POINTERS = {
    "q_ptr": "*bf16",
    "cache_ptr": "*bf16",
    "out_ptr": "*bf16",
    "part_acc_ptr": "*fp32",
    "part_ml_ptr": "*fp32",
    "seq_lens_ptr": "*i32",
    "block_table_ptr": "*i32",
    "new_k_ptr": "*bf16",
    "new_v_ptr": "*bf16",
    "slot_mapping_ptr": "*i64",
    "scales_ptr": "*u8",
    "sinks_ptr": "*bf16",
}
#: the pointer and stride arguments a quantized cache's launch gets as multiples of 16
ALIGNED_CACHE_ARGS = (
    "q_ptr",
    "cache_ptr",
    "scales_ptr",
    "stride_q_token",
    "stride_q_head",
    "stride_cache_block",
    "stride_cache_offset",
    "stride_cache_head",
    "stride_scales_block",
    "stride_scales_offset",
)
REDUCE_POINTERS = {
    "part_acc_ptr": "*fp32",
    "part_ml_ptr": "*fp32",
    "out_ptr": "*bf16",
    "sinks_ptr": "*i32",
    "signs_ptr": "*fp32",
    "rotation_ptr": "*fp32",
}
MODEL_DTYPE_CACHE = dict(KEY_FORMAT=0, VALUE_FORMAT=0, KEY_BYTES=0, VALUE_BYTES=0)


def test_decode_kernel_compiles_for_hopper_and_the_fused_store_stays():
    forms = [(4, False, False), (8, True, False), (8, True, True)]  # (GROUP, IS_SPLIT, USE_WINDOW)
    cases = [
        HopperCompile(
            "fw_triton_attention.decode:_decode_attention_kernel",
            POINTERS,
            dict(
                GROUP=group,
                BLOCK_H=16,
                BLOCK_N=64,
                BLOCK_D=128,
                PAGE=16,
                IS_SPLIT=split,
                STORE_NEW_KV=store,
                USE_WINDOW=window,
                USE_CHUNK=window,  # the windowed forms also bound the keys by a chunk (Llama 4)
                USE_SOFT_CAP=False,
                FP32=False,
                USE_SINKS=False,
                **MODEL_DTYPE_CACHE,
            ),
            float_args=("sm_scale", "soft_cap"),
            options=dict(num_warps=4, num_stages=2),
        )
        for store in (True, False)
        for group, split, window in forms
    ]
    ptx = compile_for_hopper(cases)
    assert all(".target sm_90" in text for text in ptx)
    fused, plain = ptx[: len(forms)], ptx[len(forms) :]
    for with_store, without in zip(fused, plain, strict=True):  # the K and V stores were not compiled away
        assert with_store.count("st.global") > without.count("st.global") > 0


def test_more_shared_memory_than_an_sm_has_fails_the_check():
    too_big = HopperCompile(
        "fw_triton_attention.decode:_decode_attention_kernel",
        POINTERS,
        dict(
            GROUP=8,
            BLOCK_H=16,
            BLOCK_N=256,
            BLOCK_D=256,
            PAGE=16,
            IS_SPLIT=True,
            STORE_NEW_KV=True,
            USE_WINDOW=False,
            USE_CHUNK=False,
            USE_SOFT_CAP=False,
            FP32=False,
            USE_SINKS=False,
            **MODEL_DTYPE_CACHE,
        ),
        float_args=("sm_scale", "soft_cap"),
        options=dict(num_warps=4, num_stages=4),
    )
    with pytest.raises(ValueError, match=r"bytes of shared memory; an H100/H200 SM has 232448"):
        compile_for_hopper([too_big])


#: (key format, value format, key bytes, value bytes) of fp8, turbo8, turbo4, turbo3 rows of head size 128
QUANTIZED_ROWS = [(8, 8, 128, 128), (8, 4, 128, 64), (4, 4, 64, 64), (3, 4, 48, 64)]


def test_quantized_cache_kernels_compile_for_hopper():
    quantized = {**POINTERS, "cache_ptr": "*u8"}
    decode = [
        HopperCompile(
            "fw_triton_attention.decode:_decode_attention_kernel",
            # turbo dtypes: the backend passes the rotated query and takes the rotated output in float32
            quantized if key == value == 8 else {**quantized, "q_ptr": "*fp32", "out_ptr": "*fp32"},
            dict(
                GROUP=4,
                BLOCK_H=16,
                BLOCK_N=decode_tiles(key, 128)[0],
                BLOCK_D=128,
                PAGE=16,
                IS_SPLIT=True,
                STORE_NEW_KV=False,
                USE_WINDOW=False,
                USE_CHUNK=False,
                USE_SOFT_CAP=False,
                USE_SINKS=False,
                FP32=False,
                KEY_FORMAT=key,
                VALUE_FORMAT=value,
                KEY_BYTES=key_bytes,
                VALUE_BYTES=value_bytes,
            ),
            float_args=("sm_scale", "soft_cap"),
            options=dict(num_warps=decode_tiles(key, 128)[1], num_stages=2),
            divisible_by_16=ALIGNED_CACHE_ARGS,  # as a launch on a real cache specializes it
        )
        for key, value, key_bytes, value_bytes in QUANTIZED_ROWS
    ]
    prefill = [
        HopperCompile(
            "fw_triton_attention.prefill:_prefill_attention_kernel",
            {**quantized, "cu_seqlens_q_ptr": "*i32", "span_ends_ptr": "*i32"},
            dict(
                GROUP=4,
                GROUP_P2=4,
                BLOCK_Q=32,
                BLOCK_N=64,
                BLOCK_D=128,
                PAGE=16,
                USE_WINDOW=False,
                USE_CHUNK=False,
                USE_SOFT_CAP=False,
                USE_SINKS=False,
                USE_SPANS=False,
                FP32=False,
                KEY_FORMAT=key,
                VALUE_FORMAT=value,
                KEY_BYTES=key_bytes,
                VALUE_BYTES=value_bytes,
            ),
            float_args=("sm_scale", "soft_cap"),
            options=dict(num_warps=8, num_stages=3),
        )
        for key, value, key_bytes, value_bytes in QUANTIZED_ROWS[::3]
    ]
    store = [
        HopperCompile(
            "fw_triton_attention.quant_tiles:_quant_store_kernel",
            {
                "key_ptr": "*bf16" if key == value == 8 else "*fp32",  # turbo rows come rotated, in fp32
                "value_ptr": "*bf16" if key == value == 8 else "*fp32",
                "cache_ptr": "*u8",
                "scales_ptr": "*u8",
                "slot_mapping_ptr": "*i64",
                "k_static_ptr": "*fp32",
                "v_static_ptr": "*fp32",
            },
            dict(
                PAGE=16,
                HEAD_SIZE=128,
                KEY_FORMAT=key,
                VALUE_FORMAT=value,
                KEY_BYTES=key_bytes,
                HAS_K_STATIC=key == 8,
                HAS_V_STATIC=False,
                INTERPRETED=False,
            ),
            options=dict(num_warps=1),
        )
        for key, value, key_bytes, _ in QUANTIZED_ROWS
    ]
    # turbo dtypes: the reduce rotates the output back (kv_quant.unrotate), for one split too
    reduce = [
        HopperCompile(
            "fw_triton_attention.decode:_decode_reduce_kernel",
            REDUCE_POINTERS,
            dict(SPLITS_P2=64, BLOCK_D=128, USE_SINKS=False, UNROTATE=True, GROUP=4),
            options=dict(num_warps=8),
        )
    ]
    ptx = compile_for_hopper(decode + prefill + store + reduce)
    assert all(".target sm_90" in text for text in ptx)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx[len(decode) + len(prefill)]  # fp8 keys: the hardware conversion
    # fp8 and int4 rows are read as 16-byte async copies into shared memory, not byte by byte (at
    # ddb3fb2 the fp8 decode made 136 byte loads a tile); what bytes are left are the scale codes
    for text, (key, value, _, _) in zip(ptx[: len(decode)], QUANTIZED_ROWS, strict=True):
        if key != 3:
            assert "cp.async.cg.shared.global" in text, (key, value)
            assert text.count("ld.global.b8") <= 8, (key, value)
            # tiles in float16 units: e4m3 pairs by one conversion each, int4 by integer ops alone
            assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in text, (key, value)
            assert ("cvt.rn.f16x2.e4m3x2" in text) == (8 in (key, value)), (key, value)
            assert "cvt.rn.f32.s32" not in text and "cvt.rn.f16.u32" not in text, (key, value)


def test_kernels_with_attention_sinks_compile_for_hopper():
    """gpt-oss's shapes (8 query heads per KV head, head 64): the sink in the unsplit decode, the
    split decode's reduce and the prefill, where it seeds the running softmax; with a window and
    a chunk bound (Llama 4) and bidirectional spans (Gemma 3) on the keys, so those branches compile too."""
    decode = dict(
        BLOCK_H=16,
        BLOCK_N=64,
        BLOCK_D=64,
        PAGE=16,
        STORE_NEW_KV=True,
        USE_WINDOW=True,
        USE_CHUNK=True,
        USE_SOFT_CAP=False,
    )
    cases = [
        HopperCompile(
            "fw_triton_attention.decode:_decode_attention_kernel",
            POINTERS,
            dict(GROUP=8, IS_SPLIT=split, USE_SINKS=True, FP32=False, **decode, **MODEL_DTYPE_CACHE),
            float_args=("sm_scale", "soft_cap"),
            options=dict(num_warps=4, num_stages=2),
        )
        for split in (False, True)
    ]
    cases.append(
        HopperCompile(
            "fw_triton_attention.decode:_decode_reduce_kernel",
            {**REDUCE_POINTERS, "sinks_ptr": "*bf16"},
            dict(SPLITS_P2=8, BLOCK_D=64, USE_SINKS=True, UNROTATE=False, GROUP=8),
            options=dict(num_warps=4),
        )
    )
    prefill_pointers = {
        "q_ptr": "*bf16",
        "cache_ptr": "*bf16",
        "out_ptr": "*bf16",
        "cu_seqlens_q_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "block_table_ptr": "*i32",
        "sinks_ptr": "*bf16",
        "span_ends_ptr": "*i32",
        "scales_ptr": "*u8",
    }
    cases.append(
        HopperCompile(
            "fw_triton_attention.prefill:_prefill_attention_kernel",
            prefill_pointers,
            dict(
                GROUP=8,
                GROUP_P2=8,
                BLOCK_Q=16,
                BLOCK_N=64,
                BLOCK_D=64,
                PAGE=16,
                USE_WINDOW=True,
                USE_CHUNK=True,
                USE_SOFT_CAP=False,
                USE_SINKS=True,
                USE_SPANS=True,  # Gemma 3's bidirectional image spans widen the keys too
                FP32=False,
                **MODEL_DTYPE_CACHE,
            ),
            float_args=("sm_scale", "soft_cap"),
            options=dict(num_warps=8, num_stages=3),
        )
    )
    ptx = compile_for_hopper(cases)
    assert all(".target sm_90" in text for text in ptx)


#: DeepSeek-V2-Lite / V3 / GLM-4.7-Flash latents: kv_lora_rank 512, qk_rope_head_dim 64, page 16
MLA_TILES = dict(BLOCK_L=512, BLOCK_R=64, PAGE=16, FP32=False)


def test_mla_kernels_compile_for_hopper_and_fit_in_shared_memory():
    """The latent store, the split decode kernel (storing the new latents or not) and the prefill
    kernel, with the tiles the wrappers choose for a 512-wide latent (the unsplit decode, which
    writes the output instead of partials, compiles too: checked by hand, left out for CI time)."""
    from fw_triton_attention.mla_decode import mla_decode_tiles
    from fw_triton_attention.mla_prefill import mla_prefill_tiles

    block_h, block_n, warps, stages = mla_decode_tiles(512)
    decode_pointers = {
        "q_ptr": "*bf16",
        "cache_ptr": "*bf16",
        "out_ptr": "*bf16",
        "part_acc_ptr": "*fp32",
        "part_ml_ptr": "*fp32",
        "seq_lens_ptr": "*i32",
        "block_table_ptr": "*i32",
        "new_ptr": "*bf16",
        "slot_mapping_ptr": "*i64",
    }
    decode = [
        HopperCompile(
            "fw_triton_attention.mla_decode:_mla_decode_kernel",
            decode_pointers,
            dict(BLOCK_H=block_h, BLOCK_N=block_n, IS_SPLIT=split, STORE_NEW=store, **MLA_TILES),
            float_args=("sm_scale",),
            options=dict(num_warps=warps, num_stages=stages),
        )
        for store in (True, False)  # split (the unsplit form only differs in its epilogue)
        for split in (True,)
    ]
    block_q, block_h, block_n, warps, stages = mla_prefill_tiles(512, 16, 4096)
    prefill = HopperCompile(
        "fw_triton_attention.mla_prefill:_mla_prefill_kernel",
        {
            "q_ptr": "*bf16",
            "cache_ptr": "*bf16",
            "out_ptr": "*bf16",
            "cu_seqlens_q_ptr": "*i32",
            "seq_lens_ptr": "*i32",
            "block_table_ptr": "*i32",
        },
        dict(BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_N=block_n, **MLA_TILES),
        float_args=("sm_scale",),
        options=dict(num_warps=warps, num_stages=stages),
    )
    store = HopperCompile(
        "fw_triton_attention.mla_decode:_store_latent_kernel",
        {"latent_ptr": "*bf16", "cache_ptr": "*bf16", "slot_mapping_ptr": "*i64"},
        dict(PAGE=16, BLOCK_T=4, BLOCK_E=1024),
        options=dict(num_warps=4),
    )
    ptx = compile_for_hopper([*decode, prefill, store])
    assert all(".target sm_90" in text for text in ptx)
    with_store, without = ptx[:2]  # the latent stores were not compiled away
    assert with_store.count("st.global") > without.count("st.global") > 0
