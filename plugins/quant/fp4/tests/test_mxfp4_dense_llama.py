"""compressed-tensors ``mxfp4-pack-quantized`` dense layers: a tiny Llama through the whole engine
against transformers on the packer's exact dequantized weights; bad group sizes refused; the
layout resolves to this plugin."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_fp4_llama import quantization_config, write_fp4_llama

from framework import LLM, plugins
from framework.errors import ConfigError
from framework.testing import PARITY_PROMPTS, check_logits_parity

LAYOUT = "compressed-tensors-mxfp4"


def test_logits_match_transformers_on_the_dequantized_weights(tmp_path):
    llm = check_logits_parity(tmp_path, write_fp4_llama(tmp_path, LAYOUT), PARITY_PROMPTS)
    down = llm.engine.core.runner.model.model.layers[1].mlp.down_proj
    assert type(down.quant_method).__name__ == "Mxfp4LinearMethod" and down.fp4_codes.shape == (128 // 8, 64)
    assert down.fp4_row_scales is None and down.fp4_format == "mxfp4"


def test_group_sizes_other_than_32_are_clear_errors(tmp_path):
    write_fp4_llama(tmp_path, LAYOUT)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="MXFP4 group size 16 is not supported; MXFP4 has one e8m0 scale per 32"):
        LLM(str(tmp_path), num_blocks=16)


def test_mxfp4_pack_quantized_resolves_to_this_plugin():
    got = plugins.call_first(
        "resolve_quantization_method",
        model_config=None,
        quantization_config=quantization_config(LAYOUT),
        requested=None,
        platform=None,
    )
    assert got == "compressed-tensors-mxfp4"


def test_dequantize_gives_the_table_values():
    from fw_fp4.formats import fold_scale_bias
    from fw_fp4.kernels.layout import dequantize_kernel_weight, to_kernel_layout
    from mxfp4_packer import dequantize_mxfp4_lut, quantize_mxfp4

    blocks, scales = quantize_mxfp4(torch.randn(40, 96, generator=torch.Generator().manual_seed(2)))
    weight = to_kernel_layout(blocks.flatten(-2), fold_scale_bias(scales, "test"), None, "mxfp4")
    expected = dequantize_mxfp4_lut(blocks, scales)
    torch.testing.assert_close(dequantize_kernel_weight(weight, torch.float32), expected, rtol=0, atol=0)
