"""Gemma configs in every form they arrive in read the way transformers reads them.

Gemma 3's ``config.json`` on the Hub (and the GGUF plugin's config) states RoPE the
transformers 4 way (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``) and may give
only ``sliding_window_pattern``; transformers 5 writes ``rope_parameters`` per layer type and
``layer_types``. Older Gemma 2 configs have no ``layer_types``.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from fw_gemma.model import layer_types, rope_parameters

from framework.config import ModelConfig

# the shape of google/gemma-3-1b-it's config.json, shrunk
GEMMA3_HUB = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 13,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "query_pre_attn_scalar": 16,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window": 512,
    "sliding_window_pattern": 6,
}
GEMMA2_OLD = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "vocab_size": 160,
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "head_dim": 16,
    "rope_theta": 10_000.0,
    "sliding_window": 4096,
}


def summary(base, scaling):
    scaling = scaling or {}
    return base, scaling.get("rope_type") or scaling.get("type") or "default", scaling.get("factor")


def model_config(hf_config: dict) -> ModelConfig:
    return ModelConfig.from_hf_config(hf_config, dtype=torch.float32)


@pytest.mark.parametrize("form", ["hub_json", "transformers5_dict"])
def test_gemma3_layer_types_and_two_ropes_match_transformers(form):
    hf = transformers.Gemma3TextConfig.from_dict({k: v for k, v in GEMMA3_HUB.items() if k != "architectures"})
    raw = GEMMA3_HUB if form == "hub_json" else {**hf.to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    config = model_config(raw)
    assert layer_types(config, 3) == hf.layer_types
    assert layer_types(config, 3).count("full_attention") == 2  # layers 5 and 11
    for layer_type in ("sliding_attention", "full_attention"):
        expected = hf.rope_parameters[layer_type]
        assert summary(*rope_parameters(config, 3, layer_type)) == summary(expected["rope_theta"], expected)
    assert summary(*rope_parameters(config, 3, "full_attention")) == (1_000_000.0, "linear", 8.0)
    assert summary(*rope_parameters(config, 3, "sliding_attention")) == (10_000.0, "default", None)


def test_gemma3_explicit_layer_types_win_over_the_pattern():
    types = ["full_attention", "sliding_attention", "sliding_attention"]
    config = model_config({**GEMMA3_HUB, "num_hidden_layers": 3, "layer_types": types})
    assert layer_types(config, 3) == types


def test_gemma2_without_layer_types_alternates_like_transformers():
    hf = transformers.Gemma2Config.from_dict({k: v for k, v in GEMMA2_OLD.items() if k != "architectures"})
    config = model_config(GEMMA2_OLD)
    assert (
        layer_types(config, 2) == hf.layer_types == ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    )
    assert summary(*rope_parameters(config, 2, "sliding_attention")) == (10_000.0, "default", None)
    new = model_config({**hf.to_dict(), "architectures": ["Gemma2ForCausalLM"]})
    assert layer_types(new, 2) == hf.layer_types
    assert summary(*rope_parameters(new, 2, "full_attention")) == (10_000.0, "default", None)


def test_gemma1_has_no_sliding_layers():
    config = model_config({**GEMMA2_OLD, "architectures": ["GemmaForCausalLM"], "model_type": "gemma"})
    assert layer_types(config, 1) == ["full_attention"] * 5
