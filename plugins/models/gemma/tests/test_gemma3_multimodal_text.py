"""Gemma 3 multimodal checkpoints (``Gemma3ForConditionalGeneration``) on text prompts.

A tiny random Gemma 3 with a one-layer SigLIP tower, written by transformers, through the whole
engine: logits and greedy ids of token prompts equal transformers' own multimodal class's (fp32),
with chunked prefill, a prefix-cache hit and preemption; the tower loads beside the text model (its
unused pooling head skipped); a sparse ``text_config`` (as Google ships gemma-3-4b-it) gets
``Gemma3TextConfig``'s defaults. Images: ``test_gemma3_vision.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from framework import LLM
from framework.testing import ModelParityTests, tiny_model_fixture, write_randomised_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=4,
    max_position_embeddings=512,
    initializer_range=0.1,
    sliding_window=6,
    query_pre_attn_scalar=24,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
)
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)


def gemma3_multimodal() -> transformers.Gemma3Config:
    return transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**TEXT),
        vision_config=transformers.SiglipVisionConfig(**VISION),
        mm_tokens_per_image=4,
        image_token_index=159,
        boi_token_index=157,
        eoi_token_index=156,
    )


tiny = tiny_model_fixture({"gemma3_multimodal": gemma3_multimodal}, write=write_randomised_model)


class TestParity(ModelParityTests):
    """Logits and greedy ids against transformers' Gemma3ForConditionalGeneration on token prompts."""


def test_checkpoint_holds_the_wrappers_names_and_a_vision_tower(tiny):
    path, reference = tiny
    from safetensors import safe_open

    assert type(reference).__name__ == "Gemma3ForConditionalGeneration"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "language_model.model.embed_tokens.weight" in names
    assert any(name.startswith("vision_tower.") for name in names)


def test_the_vision_tower_loads_beside_the_text_model_and_its_pooling_head_is_skipped(tiny):
    path, reference = tiny
    from safetensors import safe_open

    model = LLM(str(path), num_blocks=16).engine.core.runner.model
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert any(".head." in name for name in f.keys())  # SiglipVisionConfig's default vision_use_head
    text = reference.model.language_model
    assert torch.equal(model.model.layers[2].self_attn.q_norm.weight, text.layers[2].self_attn.q_norm.weight)
    tower = reference.model.vision_tower  # transformers 5 keeps no ``vision_model`` level in memory
    ours = model.vision_tower.encoder.layers[0].self_attn.q_proj.weight
    assert torch.equal(ours, tower.encoder.layers[0].self_attn.q_proj.weight)
    projector = reference.model.multi_modal_projector.mm_input_projection_weight
    assert torch.equal(model.multi_modal_projector.mm_input_projection_weight, projector)


def test_sparse_text_config_gets_gemma3_defaults(tiny, tmp_path):
    """Keys a checkpoint's text_config omits take Gemma3TextConfig's values (here the engine's
    view of them); the keys it has win."""
    path, _ = tiny
    config = json.loads((path / "config.json").read_text())
    for key in ("num_key_value_heads", "rms_norm_eps", "query_pre_attn_scalar", "sliding_window"):
        del config["text_config"][key]
    (tmp_path / "config.json").write_text(json.dumps(config))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / file).write_text((path / file).read_text())
    model = LLM(str(tmp_path), load_format="dummy", num_blocks=16).engine.core.runner.model
    seen, attention = model.config, model.model.layers[0].self_attn.attn.config
    assert seen.num_kv_heads == 4 and attention.num_kv_heads == 4 and seen.get("rms_norm_eps") == 1e-6
    assert attention.scale == 256**-0.5 and attention.sliding_window == 4096
    assert seen.num_heads == 4 and seen.hidden_size == 64 and seen.vocab_size == 160  # in the file: kept
