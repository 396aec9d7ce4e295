"""A tiny random gpt-oss written with MXFP4 experts, in gpt-oss's checkpoint layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from mxfp4_packer import dequantize_mxfp4_lut, quantize_mxfp4
from safetensors.torch import load_file, save_file

from framework.testing import write_randomised_model

#: What gpt-oss's config.json lists as left in bf16.
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def tiny_gpt_oss_config(**changes) -> transformers.GptOssConfig:
    """2 layers (sliding, full), 4 query / 2 KV heads of 16, 8 experts of width 64, hidden 64:
    whole MXFP4 blocks of 32 along both projections' inputs."""
    settings = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=512,
        initializer_range=0.1,
        swiglu_limit=3.0,
    )
    return transformers.GptOssConfig(**{**settings, **changes})


def write_mxfp4_gpt_oss(path: Path, config: transformers.GptOssConfig | None = None):
    """Write a random gpt-oss whose experts are MXFP4 (packed by the test's own packer), with random
    sinks and expert biases; returns transformers' fp32 model of the written checkpoint (it
    dequantizes MXFP4 on the CPU): the reference."""
    path = Path(path)
    model = write_randomised_model(path, config or tiny_gpt_oss_config())
    generator = torch.Generator().manual_seed(11)
    state = load_file(str(path / "model.safetensors"))
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=generator))
            experts = layer.mlp.experts
            for bias in (experts.gate_up_proj_bias, experts.down_proj_bias):
                bias.copy_(0.3 * torch.randn(bias.shape, generator=generator))
            prefix = f"model.layers.{index}"
            state[f"{prefix}.self_attn.sinks"] = layer.self_attn.sinks.clone()
            for name in ("gate_up_proj", "down_proj"):
                weight = getattr(experts, name)  # [E, in, out]
                blocks, scales = quantize_mxfp4(weight.transpose(1, 2))  # rows = outputs (gate/up interleaved)
                weight.copy_(dequantize_mxfp4_lut(blocks, scales).transpose(1, 2))
                del state[f"{prefix}.mlp.experts.{name}"]
                state[f"{prefix}.mlp.experts.{name}_blocks"] = blocks
                state[f"{prefix}.mlp.experts.{name}_scales"] = scales
                state[f"{prefix}.mlp.experts.{name}_bias"] = getattr(experts, f"{name}_bias").clone()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config_json = json.loads((path / "config.json").read_text())
    config_json["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (path / "config.json").write_text(json.dumps(config_json))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    for ours, theirs in zip(model.model.layers, reference.model.layers, strict=True):  # the writer's own check
        assert torch.equal(ours.mlp.experts.gate_up_proj, theirs.mlp.experts.gate_up_proj)
    return reference.eval()
