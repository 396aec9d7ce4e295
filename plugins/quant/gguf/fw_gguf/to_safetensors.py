"""A GGUF model dequantized into a Hugging Face checkpoint directory (16-bit safetensors).

``write_hf_checkpoint(gguf_file, out_dir)`` writes ``config.json`` (fw's reading of the metadata),
``tokenizer.json`` + ``tokenizer_config.json`` (the tokenizer fw builds from the metadata, its chat
template and special tokens), ``generation_config.json`` and ``model.safetensors`` with every
tensor under its HF name, dequantized. fw loads the directory with the same outputs as the file
(up to the 16-bit rounding of ``dtype``); it is the bf16 source the ``--isq`` quality table
quantizes again.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import torch
from safetensors.torch import save_file

from .dequant import dequantize
from .format import GGUFFormat


def write_hf_checkpoint(gguf_file: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Dequantize ``gguf_file`` into ``out_dir`` (created); returns ``out_dir``."""
    source = GGUFFormat(Path(gguf_file))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    types = source.quantization_config()["tensor_types"]
    tensors = {}
    for name, tensor in source.iter_weights():
        if name in types and tensor.dtype == torch.uint8:
            qtype = gguf.GGMLQuantizationType[types[name]]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            shape = (tensor.shape[0], tensor.shape[1] // size * block)
            tensor = dequantize(tensor, qtype, shape, torch.float32)
        tensors[name] = tensor.to(dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = source.hf_config()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = source.tokenizer()
    tokenizer.backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": tokenizer.chat_template,
                "bos_token": tokenizer.bos_token,
                "eos_token": tokenizer.eos_token,
                "pad_token": tokenizer.pad_token,
            },
            indent=2,
        )
    )
    (out / "generation_config.json").write_text(json.dumps(source.generation_config()))
    return out
