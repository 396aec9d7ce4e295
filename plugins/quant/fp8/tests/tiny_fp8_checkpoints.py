"""Tiny random transformers models rewritten by :mod:`fp8_reference` as FP8 checkpoints (HF block
``fp8``, compressed-tensors channel / tensor), with the matching ``quantization_config``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from fp8_reference import dequantize_reference, quantize_reference
from safetensors.torch import load_file, save_file

LINEAR_LEAVES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
)  # the last four: MLA (DeepSeek)
HF_BLOCK_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def compressed_tensors_config(granularity: str, static_inputs: bool) -> dict:
    inputs = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": not static_inputs,
        "strategy": "tensor" if static_inputs else "token",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": inputs,
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "dynamic": False,
                    "strategy": granularity,
                },
            }
        },
    }


def is_quantized_weight(name: str) -> bool:
    stem, _, leaf = name.rpartition(".")
    if leaf != "weight":
        return False
    parts = stem.split(".")
    return parts[-1] in LINEAR_LEAVES and "shared_expert_gate" not in parts


def quantize_checkpoint(path: Path, granularity: str = "block", static_inputs: bool = False) -> dict[str, torch.Tensor]:
    """Rewrite ``path/model.safetensors`` in place; returns the dequantized weights by checkpoint name."""
    tensors = load_file(str(path / "model.safetensors"))
    out, dense = {}, {}
    for name, value in tensors.items():
        if not is_quantized_weight(name):
            out[name] = value
            continue
        stem = name.removesuffix(".weight")
        q, scale = quantize_reference(value, granularity)
        out[name] = q
        out[f"{stem}.{'weight_scale_inv' if granularity == 'block' else 'weight_scale'}"] = scale
        if static_inputs:
            out[f"{stem}.input_scale"] = torch.tensor([0.01 + 0.001 * len(out) % 7])
        dense[name] = dequantize_reference(q, scale, granularity)
    save_file(out, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = (
        HF_BLOCK_CONFIG if granularity == "block" else compressed_tensors_config(granularity, static_inputs)
    )
    (path / "config.json").write_text(json.dumps(config))
    return dense
