"""fw's bit-manipulation decode of MXFP4 against an independent table-based packer and reader."""

from __future__ import annotations

import pytest
import torch
from fw_fp4.formats import check_mxfp4_tensors, dequantize_mxfp4, fold_scale_bias
from mxfp4_packer import E2M1_VALUES, dequantize_mxfp4_lut, quantize_mxfp4

from framework.errors import ConfigError


def test_every_code_with_every_useful_scale_decodes_as_the_table_says():
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = (codes[0::2] | (codes[1::2] << 4)).repeat(2).reshape(1, 16)  # 32 values: the codes twice
    for scale in (1, 60, 113, 127, 140, 200, 240):
        scales = torch.tensor([scale], dtype=torch.uint8)
        got = dequantize_mxfp4(blocks, fold_scale_bias(scales, "t"), torch.float32)
        expected = dequantize_mxfp4_lut(blocks, scales)
        assert torch.equal(got, expected), scale
        assert torch.equal(got[:16], E2M1_VALUES * 2.0 ** (scale - 127))


def test_packed_random_weights_decode_to_the_packers_values():
    weight = torch.randn(6, 40, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (6, 40, 4, 16) and scales.shape == (6, 40, 4)
    decoded = dequantize_mxfp4(blocks, fold_scale_bias(scales, "t"), torch.float32)
    assert torch.equal(decoded, dequantize_mxfp4_lut(blocks, scales))
    # and the packer is a real quantizer: the decoded weights are near the originals
    assert (decoded - weight).abs().max() <= weight.abs().max() / 6


def test_bf16_decode_rounds_the_exact_values():
    blocks, scales = quantize_mxfp4(torch.randn(3, 64, generator=torch.Generator().manual_seed(1)))
    got = dequantize_mxfp4(blocks, fold_scale_bias(scales, "t"), torch.bfloat16)
    assert torch.equal(got, dequantize_mxfp4_lut(blocks, scales).to(torch.bfloat16))


def test_unknown_layouts_and_out_of_range_scales_are_refused():
    blocks, scales = quantize_mxfp4(torch.randn(4, 64))
    with pytest.raises(ConfigError, match=r"32 e2m1 codes per scale"):
        check_mxfp4_tensors(blocks.reshape(4, 4, 8), scales, "w")  # 16 values per scale: not MXFP4
    with pytest.raises(ConfigError, match="one per block"):
        check_mxfp4_tensors(blocks, scales[:, :1], "w")
    with pytest.raises(ConfigError, match="e8m0"):
        check_mxfp4_tensors(blocks, scales.float(), "w")
    with pytest.raises(ConfigError, match="scales up to 240"):
        fold_scale_bias(torch.tensor([255], dtype=torch.uint8), "w")
