"""NVFP4 dense layers in both checkpoint layouts (modelopt: the global scale multiplies;
compressed-tensors: it divides): a tiny Llama through the whole engine against transformers on the
packer's exact dequantized weights (logits through the interpreted kernels, greedy ids through the
CPU's torch path), the decode against the table reading, and bad settings."""

from __future__ import annotations

import json

import pytest
import torch
from fw_fp4.formats import dequantize_nvfp4, nvfp4_row_scale
from mxfp4_packer import dequantize_nvfp4_lut, quantize_nvfp4
from tiny_fp4_llama import CONVENTIONS, quantization_config, write_fp4_llama

from framework import LLM
from framework.errors import ConfigError
from framework.testing import PARITY_PROMPTS, check_greedy_parity, check_logits_parity


@pytest.fixture(scope="module", params=sorted(CONVENTIONS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"llama_nvfp4_{request.param}")
    return path, write_fp4_llama(path, request.param)


def test_logits_match_transformers_on_the_dequantized_weights(tiny):
    llm = check_logits_parity(*tiny, PARITY_PROMPTS)
    qkv = llm.engine.core.runner.model.model.layers[0].self_attn.qkv_proj
    assert type(qkv.quant_method).__name__ == "Nvfp4LinearMethod" and qkv.fp4_codes.dtype == torch.int32


def test_greedy_tokens_match_transformers_on_the_dequantized_weights(tiny, monkeypatch):
    """Without the interpreter, the CPU's torch path (the packed layout dequantized per forward);
    the logits test above runs the interpreted kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    check_greedy_parity(*tiny, PARITY_PROMPTS[:2], steps=16)


@pytest.mark.parametrize("convention", ["multiply", "divide"])
def test_decode_matches_the_table_reading(convention):
    weight = torch.randn(24, 64, generator=torch.Generator().manual_seed(4))
    tensors = quantize_nvfp4(weight, convention)
    packed = tensors.get("weight", tensors.get("weight_packed"))
    global_scale = tensors.get("weight_scale_2", tensors.get("weight_global_scale"))
    rows = nvfp4_row_scale(global_scale.reshape(1), convention).expand(24)
    got = dequantize_nvfp4(packed, tensors["weight_scale"], rows, torch.float32)
    torch.testing.assert_close(got, dequantize_nvfp4_lut(tensors), rtol=1e-6, atol=0)
    assert (got - weight).abs().max() <= weight.abs().max() / 6  # a real quantizer


@pytest.mark.parametrize("layout", sorted(CONVENTIONS))
def test_unknown_group_sizes_are_clear_errors(tmp_path, layout):
    write_fp4_llama(tmp_path, layout)
    config = json.loads((tmp_path / "config.json").read_text())
    quant = quantization_config(layout)
    if layout == "modelopt":
        quant["group_size"] = 32
    else:
        quant["config_groups"]["group_0"]["weights"]["group_size"] = 32
    config["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="NVFP4 group size 32 is not supported; NVFP4 has one fp8 e4m3 scale per 16"):
        LLM(str(tmp_path), num_blocks=16)


def test_modelopt_nvfp4_checkpoints_resolve_to_this_plugin():
    from framework import plugins

    resolve = lambda config: plugins.call_first(  # noqa: E731
        "resolve_quantization_method", model_config=None, quantization_config=config, requested=None, platform=None
    )
    assert resolve(quantization_config("modelopt")) == "modelopt-nvfp4"
    assert resolve(quantization_config("compressed-tensors")) == "compressed-tensors-nvfp4"
    assert resolve({"quant_method": "mxfp4"}) == "mxfp4"
