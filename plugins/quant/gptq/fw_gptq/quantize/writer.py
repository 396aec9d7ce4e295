"""Write a quantized checkpoint that other engines load too: ``config.json`` with its
``quantization_config``, the tokenizer files, and safetensors shards where each quantized linear
layer's ``weight`` is replaced by its format's tensors (:mod:`fw_gptq.packing`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from ..packing import IntWeight, pack_awq, pack_compressed, pack_gptq

SHARD_BYTES = 4 * 2**30
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def quantization_config(fmt: str, bits: int, group_size: int, symmetric: bool, desc_act: bool) -> dict:
    """The ``quantization_config`` of ``fmt`` (gptq | awq | compressed-tensors) as its tools write it."""
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "desc_act": desc_act,
            "sym": symmetric,
            "checkpoint_format": "gptq",
            "damp_percent": 0.01,
            "true_sequential": False,
        }
    if fmt == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True, "version": "gemm"}
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "channel" if group_size == -1 else "group",
        "group_size": None if group_size == -1 else group_size,
        "actorder": None,
        "dynamic": False,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
    }


def pack(fmt: str, weight: IntWeight, dtype: torch.dtype) -> dict[str, Tensor]:
    if fmt == "gptq":
        return pack_gptq(weight)
    if fmt == "awq":
        return pack_awq(weight)
    if fmt == "compressed-tensors":
        return pack_compressed(weight, dtype)
    raise ValueError(f"unknown checkpoint format {fmt!r}; valid: gptq, awq, compressed-tensors")


def write_checkpoint(
    src: Path,
    dst: Path,
    tensors: dict[str, Tensor],
    quantized: dict[str, IntWeight],
    fmt: str,
    config_update: dict,
    dtype: torch.dtype,
) -> list[Path]:
    """Write ``tensors`` (float; cast to ``dtype``) with every ``name`` of ``quantized`` (a layer
    prefix) stored as its packed tensors instead of ``name.weight``; returns the files written."""
    dst.mkdir(parents=True, exist_ok=True)
    out: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        stem = name.removesuffix(".weight")
        if name.endswith(".weight") and stem in quantized:
            out.update(
                {f"{stem}.{key}": value.contiguous() for key, value in pack(fmt, quantized[stem], dtype).items()}
            )
        else:
            out[name] = tensor.to(dtype).contiguous() if tensor.is_floating_point() else tensor.contiguous()
    shards, current, size = [], {}, 0
    for name, tensor in out.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name], size = tensor, size + nbytes
    shards.append(current)
    files = []
    if len(shards) == 1:
        files.append(dst / "model.safetensors")
        save_file(shards[0], str(files[0]), metadata={"format": "pt"})
    else:
        weight_map = {}
        for index, shard in enumerate(shards, 1):
            path = dst / f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, path.name))
            files.append(path)
        (dst / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
        )
    config = json.loads((src / "config.json").read_text())
    config.update(config_update)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    return files
