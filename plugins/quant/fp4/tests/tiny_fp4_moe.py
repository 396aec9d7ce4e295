"""A tiny random Qwen3-MoE whose decoder linears and experts are FP4 in one of the checkpoint layouts
(``tiny_fp4_llama.LAYOUTS``), written as real checkpoints are: one tensor set per expert
(``mlp.experts.N.gate_proj.weight_packed`` ...), packed by the tests' own packer (``mxfp4_packer``),
the router (``mlp.gate``) left 16-bit and listed as ignored."""

from __future__ import annotations

import json

import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_fp4_llama import pack, quantization_config

from framework.testing import write_randomised_model

#: The checkpoint's linear layers that are packed: attention and every expert's projections.
PACKED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def moe_quantization_config(layout: str) -> dict:
    """:func:`tiny_fp4_llama.quantization_config` with the routers left out too, as each format lists them."""
    config = quantization_config(layout)
    if layout == "modelopt":
        config["exclude_modules"] = ["lm_head", "model.layers.*.mlp.gate"]
    else:
        config["ignore"] = ["lm_head", "re:.*mlp[.]gate$"]
    return config


def write_fp4_qwen3_moe(path, layout: str):
    """Write the tiny Qwen3-MoE to ``path`` in ``layout``; returns transformers' fp32 model holding the
    packed weights' exact values (the experts' stacked parameters rebuilt from the per-expert ones)."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    model = write_randomised_model(path, config)
    state = load_file(str(path / "model.safetensors"))
    dense = {}
    for name in [n for n in state if n.endswith(".weight") and n.rsplit(".", 2)[-2] in PACKED]:
        tensors, dense[name] = pack(state.pop(name), layout)
        stem = name.removesuffix(".weight")
        state.update({f"{stem}.{key}": value for key, value in tensors.items()})
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in dense:
                param.copy_(dense[name])
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                stem = name.rsplit(".", 1)[0]
                for e in range(param.shape[0]):
                    if name.endswith("gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
                        gate, up = (dense[f"{stem}.{e}.{p}_proj.weight"] for p in ("gate", "up"))
                        param[e].copy_(torch.cat([gate, up]))
                    else:
                        param[e].copy_(dense[f"{stem}.{e}.down_proj.weight"])
    config_json = json.loads((path / "config.json").read_text())
    config_json["quantization_config"] = moe_quantization_config(layout)
    (path / "config.json").write_text(json.dumps(config_json))
    return model
