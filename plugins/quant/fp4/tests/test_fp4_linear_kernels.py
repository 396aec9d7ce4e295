"""The FP4 dense kernels (``fw_fp4.kernels.fp4_linear``) against dequantize-then-matmul of the test
packer's own table reading: under the Triton interpreter in fp32 (the interpreter computes bf16
wrongly) for the GEMV, split-K, tensor-core tile and dequantize + cuBLAS forms, ragged outputs and
both NVFP4 checkpoint conventions; compiled for sm_90 through ptxas; on CUDA at Llama-3-8B shapes."""

from __future__ import annotations

import functools

import pytest
import torch
from mxfp4_packer import dequantize_mxfp4_lut, dequantize_nvfp4_lut, quantize_mxfp4, quantize_nvfp4

from framework.testing import HopperCompile, compile_for_hopper, interpreted, require_triton

require_triton()

from fw_fp4.formats import fold_scale_bias, nvfp4_row_scale  # noqa: E402
from fw_fp4.kernels.fp4_linear import (  # noqa: E402
    GEMV_MAX_ROWS,
    choose_config,
    fp4_dequantize,
    fp4_matmul,
)
from fw_fp4.kernels.layout import dequantize_kernel_weight, to_kernel_layout  # noqa: E402


def nvfp4_weight(n: int, k: int, convention: str, seed: int, device: str = "cpu"):
    """A random NVFP4 weight in the kernel layout and its table reading ``[n, k]`` (float32)."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    tensors = quantize_nvfp4(weight, convention)
    packed = tensors.get("weight", tensors.get("weight_packed"))
    global_scale = tensors.get("weight_scale_2", tensors.get("weight_global_scale")).reshape(1)
    rows = nvfp4_row_scale(global_scale, convention).expand(n)
    kernel = to_kernel_layout(packed.to(device), tensors["weight_scale"].to(device), rows.to(device), "nvfp4")
    return kernel, dequantize_nvfp4_lut(tensors).to(device)


def mxfp4_weight(n: int, k: int, seed: int):
    """A random MXFP4 weight in the kernel layout (scale bytes rebased) and its table reading."""
    blocks, scales = quantize_mxfp4(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    kernel = to_kernel_layout(blocks.flatten(-2), fold_scale_bias(scales, "test"), None, "mxfp4")
    return kernel, dequantize_mxfp4_lut(blocks, scales)


def reference(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    return (x.double() @ dense.double().T).float()


CONVENTIONS = ["multiply", "divide"]  # modelopt's weight_scale_2, compressed-tensors' weight_global_scale
CASES = [  # (n, k, rows, forced config or None)
    (96, 256, 1, None),
    (200, 512, 3, None),  # ragged N: two blocks of 128, the second partly masked
    (72, 128, 17, None),  # the tile form (32-row tiles)
    (64, 256, 130, None),  # dequantize + matmul
    (64, 256, 130, {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1}),  # the fused tile form
    (136, 1024, 1, {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 256, "SUB_K": 128, "SPLIT_K": 4}),  # split-K
    (48, 48, 2, None),  # K below a slice: masked inputs
    (136, 1024, 2, {"KIND": "gemv", "BLOCK_N": 128, "BLOCK_K": 256, "SUB_K": 128, "SPLIT_K": 4}),  # GEMV split-K
    (136, 96, 1, {"KIND": "gemv", "BLOCK_N": 64, "BLOCK_K": 64, "SUB_K": 32, "SPLIT_K": 1}),  # K past a step
]


@interpreted
@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize(
    "n,k,rows,config", CASES, ids=[f"{n}x{k}-rows{r}{'-forced' * bool(c)}" for n, k, r, c in CASES]
)
def test_interpreted_kernel_matches_dequantize_then_matmul_fp32(convention, n, k, rows, config):
    weight, dense = nvfp4_weight(n, k, convention, seed=n + k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    out = fp4_matmul(x, weight, config)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference(x, dense), rtol=1e-5, atol=1e-4)


MXFP4_CASES = [
    (200, 256, 1, None),
    (64, 512, 17, None),
    (72, 256, 130, None),
    (96, 1024, 2, {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 256, "SPLIT_K": 2}),
]


@interpreted
@pytest.mark.parametrize("n,k,rows,config", MXFP4_CASES, ids=[f"{n}x{k}-rows{r}" for n, k, r, _ in MXFP4_CASES])
def test_interpreted_mxfp4_kernel_matches_dequantize_then_matmul_fp32(n, k, rows, config):
    weight, dense = mxfp4_weight(n, k, seed=n + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(fp4_matmul(x, weight, config), reference(x, dense), rtol=1e-5, atol=1e-4)


def test_the_rule_splits_k_for_few_output_blocks_and_tiles_prefill():
    gemv = choose_config(1, 1024, 4096)
    assert gemv["KIND"] == "gemv" and gemv["SPLIT_K"] == 8 and gemv["BLOCK_K"] == 512
    assert choose_config(1, 14336 * 2, 4096)["SPLIT_K"] == 4  # 224 output blocks: 4 splits, 6.8 programs an SM
    dot = choose_config(3, 1024, 4096)
    assert dot["KIND"] == "dot" and dot["BLOCK_M"] == 16 and dot["SPLIT_K"] == 4
    assert choose_config(3, 14336 * 2, 4096)["SPLIT_K"] == 1  # 224 output blocks fill the SMs
    assert choose_config(64, 4096, 4096)["BLOCK_M"] == 64


@interpreted
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_layout_and_dequantize_kernel_give_the_table_values(convention):
    weight, dense = nvfp4_weight(136, 96, convention, seed=3)
    assert weight.codes.shape == (12, 136) and weight.codes.dtype == torch.int32
    torch.testing.assert_close(dequantize_kernel_weight(weight, torch.float32), dense, rtol=1e-6, atol=0)
    torch.testing.assert_close(fp4_dequantize(weight, torch.float32), dense.T, rtol=1e-6, atol=0)


#: What a GPU launch sees as multiples of 16 (torch's allocations, Llama's sizes): vectorized loads.
ALIGNED = ("x_ptr", "codes_ptr", "scales_ptr", "row_scales_ptr", "out_ptr", "N", "K", "stride_xm", "stride_om")


def test_the_kernels_compile_for_hopper_with_tensor_core_dots():
    matmul = {"x_ptr": "*bf16", "codes_ptr": "*i32", "scales_ptr": "*u8", "row_scales_ptr": "*fp32", "out_ptr": "*bf16"}
    nvfp4 = {"GROUP": 16, "E8M0": False, "HAS_ROW_SCALES": True, "FP32": False}
    cases = []
    for rows in (3, 64):
        config = choose_config(rows, 4096, 4096)
        config.pop("SPLIT_K"), config.pop("KIND")
        options = dict(num_warps=config.pop("num_warps"), num_stages=config.pop("num_stages"))
        cases.append(
            HopperCompile(
                "fw_fp4.kernels.fp4_linear:fp4_matmul_kernel",
                matmul,
                {**nvfp4, **config},
                options=options,
                divisible_by_16=ALIGNED,
            )
        )
    mxfp4 = {"GROUP": 32, "E8M0": True, "HAS_ROW_SCALES": False, "FP32": False}  # its branch: in the GEMV
    gemv = choose_config(1, 4096, 4096)
    gemv.pop("SPLIT_K"), gemv.pop("KIND")
    options = dict(num_warps=gemv.pop("num_warps"), num_stages=gemv.pop("num_stages"))
    for fmt in (nvfp4, mxfp4):
        meta = {key: value for key, value in fmt.items() if key != "FP32"}
        cases.append(
            HopperCompile(
                "fw_fp4.kernels.fp4_linear:fp4_gemv_kernel",
                matmul,
                {**meta, **gemv},
                options=options,
                divisible_by_16=ALIGNED,
            )
        )
    dequant = {"codes_ptr": "*i32", "scales_ptr": "*u8", "row_scales_ptr": "*fp32", "out_ptr": "*bf16"}
    cases.append(
        HopperCompile(
            "fw_fp4.kernels.fp4_linear:fp4_dequantize_kernel",
            dequant,
            {"GROUP": 16, "E8M0": False, "HAS_ROW_SCALES": True, "BLOCK_K": 64, "BLOCK_N": 128},
        )
    )
    ptx = compile_for_hopper(cases)
    assert all(".target sm_90" in text for text in ptx)
    assert all("mma" in text for text in ptx[:2])  # the dots run on tensor cores


LLAMA3_8B = {
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
}


@functools.lru_cache(maxsize=4)
def llama3_8b_weight(layer: str):
    """Random NVFP4 codes and e4m3 scales of ``layer``'s shape (no quantizer: fast at this size),
    in the kernel layout on CUDA, and their table reading (float32, CUDA)."""
    n, k = LLAMA3_8B[layer]
    generator = torch.Generator().manual_seed(n + k)
    tensors = {
        "weight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator),
        "weight_scale": (32 + 96 * torch.rand(n, k // 16, generator=generator)).to(torch.float8_e4m3fn),
        "weight_scale_2": torch.tensor(3e-4),
    }
    rows = torch.full((n,), 3e-4).cuda()
    kernel = to_kernel_layout(tensors["weight"].cuda(), tensors["weight_scale"].cuda(), rows, "nvfp4")
    return kernel, dequantize_nvfp4_lut(tensors).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("layer", sorted(LLAMA3_8B))
@pytest.mark.parametrize("rows", [1, 2, 4, 17, 64, 256])
def test_cuda_kernel_matches_dequantize_then_matmul_at_llama3_8b_shapes(layer, rows):
    weight, dense = llama3_8b_weight(layer)
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(rows)).to("cuda", torch.bfloat16)
    expected = reference(x.float(), dense)
    scale = expected.abs().max().item()
    # one row takes the integer GEMV on CUDA: x rounded to int8 per 32 inputs (test_fp4_int8_gemv.py)
    out = fp4_matmul(x, weight, None if rows > 1 else {**choose_config(1, *LLAMA3_8B[layer]), "KIND": "gemv"})
    assert out.dtype == torch.bfloat16
    # bf16 output rounding; the weight values are exact in bf16 before the global scale
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2 * scale)
    forced = {"KIND": "dot", "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1}
    if rows <= GEMV_MAX_ROWS:
        forced = {"KIND": "dot", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 512, "SPLIT_K": 2, "num_stages": 4}
    torch.testing.assert_close(fp4_matmul(x, weight, forced).float(), expected, rtol=1e-2, atol=1e-2 * scale)
