"""A tiny random Llama whose decoder linears are FP4 in one of the dense checkpoint layouts,
packed by the tests' own packer (``mxfp4_packer``)."""

from __future__ import annotations

import json

import torch
import transformers
from mxfp4_packer import dequantize_mxfp4_lut, dequantize_nvfp4_lut, quantize_mxfp4, quantize_nvfp4
from safetensors.torch import load_file, save_file

from framework.testing import write_randomised_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: NVFP4 layouts -> their global-scale convention; MXFP4's has none.
CONVENTIONS = {"modelopt": "multiply", "compressed-tensors": "divide"}
LAYOUTS = (*CONVENTIONS, "compressed-tensors-mxfp4")


def quantization_config(layout: str) -> dict:
    """``config.json``'s ``quantization_config`` of ``layout`` (``lm_head`` left in 16 bits)."""
    if layout == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    mxfp4 = layout == "compressed-tensors-mxfp4"
    weights = {
        "num_bits": 4,
        "type": "float",
        "group_size": 32 if mxfp4 else 16,
        "strategy": "group" if mxfp4 else "tensor_group",
        "symmetric": True,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized" if mxfp4 else "nvfp4-pack-quantized",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }


def pack(weight: torch.Tensor, layout: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``weight [N, K]`` as ``layout``'s tensors, and the table reading of them (float32)."""
    if layout in CONVENTIONS:
        tensors = quantize_nvfp4(weight, CONVENTIONS[layout])
        return tensors, dequantize_nvfp4_lut(tensors)
    blocks, scales = quantize_mxfp4(weight)
    return {"weight_packed": blocks.flatten(-2), "weight_scale": scales}, dequantize_mxfp4_lut(blocks, scales)


def write_fp4_llama(path, layout: str):
    """Write the tiny Llama to ``path`` with its decoder linears in ``layout``; returns transformers'
    fp32 model holding the packed weights' exact values."""
    config = transformers.LlamaConfig(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    model = write_randomised_model(path, config)
    state = load_file(str(path / "model.safetensors"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
                tensors, dense = pack(param, layout)
                param.copy_(dense)
                del state[name]
                stem = name.removesuffix(".weight")
                state.update({f"{stem}.{key}": value for key, value in tensors.items()})
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config_json = json.loads((path / "config.json").read_text())
    config_json["quantization_config"] = quantization_config(layout)
    (path / "config.json").write_text(json.dumps(config_json))
    return model
