"""Llama 4 text through the whole engine matches transformers (fp32, tiny random models).

The tiny config keeps every switch live within a few dozen tokens: chunks of 8 positions on the
RoPE layers (prompts and prefix-cache hits cross chunk borders), NoPE layers every second layer
with ``floor_scale=4`` so the temperature tuning scales queries from position 3 on, the L2 QK
norm, and MoE layers (top-1 of 4 experts plus the shared expert) between dense ones.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from framework import LLM
from framework.testing import ModelParityTests, reference_logits, tiny_llama4_text, tiny_model_fixture

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = tiny_llama4_text()

CONFIGS = {
    "llama4_chunked_nope_moe": lambda: transformers.Llama4TextConfig(**SMALL),
    # llama3 rope scaling (Scout's), no QK norm (Maverick's), top-2 routing: each choice its own scaled input
    "llama4_scaled_rope_top2": lambda: transformers.Llama4TextConfig(
        **{**SMALL, "num_experts_per_tok": 2, "use_qk_norm": False, "interleave_moe_layer_step": 1},
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}

#: the full parity suite runs on the first config; the second checks logits and greedy ids
tiny = tiny_model_fixture({"llama4_chunked_nope_moe": CONFIGS["llama4_chunked_nope_moe"]})
tiny_top2 = tiny_model_fixture({"llama4_scaled_rope_top2": CONFIGS["llama4_scaled_rope_top2"]})


class TestParity(ModelParityTests):
    """Logits and greedy ids against transformers: batched chunked prefill, a prefix-cache hit, preemption."""


def test_llama3_rope_no_qk_norm_top2_routing_match_transformers(tiny_top2):
    """Each of the two choices scales its own input; Scout's llama3 rope; Maverick's missing QK norm."""
    from framework.testing import PARITY_PROMPTS, check_greedy_parity, check_logits_parity

    llm = check_logits_parity(*tiny_top2, PARITY_PROMPTS)
    layers = llm.engine.core.runner.model.model.layers
    assert all(layer.feed_forward.top_k == 2 and not layer.self_attn.use_qk_norm for layer in layers)
    check_greedy_parity(*tiny_top2, PARITY_PROMPTS)


def test_layers_follow_the_config_switches(tiny):
    path, reference = tiny
    model = LLM(str(path), num_blocks=16).engine.core.runner.model
    config = reference.config
    for index, (ours, theirs) in enumerate(zip(model.model.layers, reference.model.layers, strict=True)):
        attention = ours.self_attn
        assert (attention.rotary_emb is not None) == bool(config.no_rope_layers[index])
        expected_chunk = 8 if config.layer_types[index] == "chunked_attention" else None
        assert attention.attn.config.attention_chunk_size == expected_chunk
        assert hasattr(ours.feed_forward, "experts") == theirs.is_moe_layer
        if theirs.is_moe_layer:  # transformers' [E, H, 2I] stacked experts, transposed on load
            assert torch.equal(ours.feed_forward.experts.w13_weight, theirs.feed_forward.experts.gate_up_proj.mT)
    assert {layer.self_attn.attn.config.attention_chunk_size for layer in model.model.layers} == {8, None}


def test_chunked_attention_and_temperature_tuning_change_the_logits(tiny):
    """Without the chunk mask or the NoPE query scaling transformers' own logits move far beyond
    the parity tolerance: the parity tests above really pin both."""
    _, reference = tiny
    prompt = list(range(3, 40))
    base = reference_logits(reference, prompt)
    scale = base.abs().max()
    reference.config.attention_chunk_size = 10_000
    try:
        unchunked = reference_logits(reference, prompt)
    finally:
        reference.config.attention_chunk_size = 8
    assert (unchunked - base).abs().max() > 1e-2 * scale
    for layer in reference.model.layers:
        layer.self_attn.attn_temperature_tuning = False
    try:
        untuned = reference_logits(reference, prompt)
    finally:
        for layer in reference.model.layers:
            layer.self_attn.attn_temperature_tuning = True
    assert (untuned - base).abs().max() > 1e-2 * scale


@pytest.mark.gpu
def test_gpu_fast_path_matches_transformers_with_cuda_graphs(tmp_path):
    """The Triton attention backend (chunked layers included), Triton fused_moe and CUDA-graphed
    decode steps give transformers' greedy ids (fp32); a fallback to torch fails."""
    from framework.testing import (
        PARITY_PROMPTS,
        check_greedy_parity,
        check_kernels_used,
        count_kernel_calls,
        write_tiny_model,
    )

    reference = write_tiny_model(tmp_path, CONFIGS["llama4_chunked_nope_moe"]())
    with count_kernel_calls() as calls:
        llm = LLM(str(tmp_path), device="cuda", dtype="f32", num_blocks=64)
        assert "decode graphs" in llm.engine.summary["cuda_graphs"]
        check_greedy_parity(
            tmp_path,
            reference,
            [*PARITY_PROMPTS, list(range(2, 66))],
            device="cuda",
            dtype="f32",
            prefill_chunk_size=64,
            max_num_batched_tokens=128,
        )
    check_kernels_used(calls, {"attention": "triton", "fused_moe": "triton"})


def test_multimodal_checkpoint_gives_its_text_models_logits_on_token_prompts(tmp_path):
    """Llama4ForConditionalGeneration (how Scout and Maverick are released; images are
    ``test_llama4_vision.py``'s): the text model under ``language_model.`` gives transformers'
    logits on token prompts, and the vision model's tensors load beside it."""
    import json

    from framework.testing import PARITY_PROMPTS, check_logits_parity, make_tiny_tokenizer

    vision = dict(
        hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    vision.update(vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    config = transformers.Llama4Config(text_config=CONFIGS["llama4_chunked_nope_moe"]().to_dict(), vision_config=vision)
    torch.manual_seed(0)
    reference = transformers.Llama4ForConditionalGeneration(config).eval()
    reference.save_pretrained(tmp_path)
    make_tiny_tokenizer(160).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    # transformers 5.24's multimodal forward fails on text alone (it reads outputs.image_outputs), so
    # the reference is its language model: the very module its text path runs
    llm = check_logits_parity(tmp_path, reference.language_model, PARITY_PROMPTS[:2])
    model = llm.engine.core.runner.model
    assert torch.equal(model.vision_model.positional_embedding_vlm, reference.vision_model.positional_embedding_vlm)
    assert torch.equal(model.multi_modal_projector.linear_1.weight, reference.multi_modal_projector.linear_1.weight)
