"""Gemma 4 text through the whole engine matches transformers (fp32, tiny random models).

The tiny configs keep every switch live: sliding (window 6) and global layers of different head
sizes and KV-head counts, proportional RoPE on the global layers, keys as values
(``attention_k_eq_v``), the last layers sharing the K/V of earlier ones with double-wide MLPs,
per-layer inputs, the MoE branch (GeGLU experts, scaled router), random ``layer_scalar``s, norms
and router scales, and final-logit soft-capping.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from framework import LLM
from framework.testing import ModelParityTests, tiny_gemma4_text, tiny_model_fixture, write_tiny_model
from framework.testing.model_writers import randomise_identity_params

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = tiny_gemma4_text()

CONFIGS = {
    # E2B-like: shared KV on the last two layers (double-wide MLPs), per-layer inputs, k = v on global layers
    "gemma4_shared_kv_per_layer_inputs": lambda: transformers.Gemma4TextConfig(**tiny_gemma4_text(shared_kv=True)),
    # 26B-A4B-like: no sharing, no per-layer inputs, separate v projections, a GeGLU-experts branch
    # (top-2 of 4) beside every layer's MLP
    "gemma4_moe": lambda: transformers.Gemma4TextConfig(
        **SMALL,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        global_head_dim=32,
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
}


def write_randomised(path, config):
    """Random norms, and ``layer_scalar``s and the routers' scales in [0.5, 1.5] (ones in a fresh model)."""
    reference = write_tiny_model(path, config)
    randomise_identity_params(reference)
    generator = torch.Generator().manual_seed(4)
    text = getattr(reference.model, "language_model", reference.model)  # a multimodal wrapper's text model
    with torch.no_grad():
        for layer in text.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=generator))
            if layer.enable_moe_block:
                for param in (layer.router.scale, layer.router.per_expert_scale):
                    param.copy_(0.5 + torch.rand(param.shape, generator=generator))
    reference.save_pretrained(path)
    return reference


#: the full parity suite runs on the first config; the MoE one checks logits and greedy ids
tiny = tiny_model_fixture(
    {"gemma4_shared_kv_per_layer_inputs": CONFIGS["gemma4_shared_kv_per_layer_inputs"]}, write=write_randomised
)
tiny_moe = tiny_model_fixture({"gemma4_moe": CONFIGS["gemma4_moe"]}, write=write_randomised)


class TestParity(ModelParityTests):
    """Logits and greedy ids against transformers: batched chunked prefill, a prefix-cache hit, preemption."""


def test_moe_branch_matches_transformers(tiny_moe):
    """The GeGLU experts beside every layer's MLP, the scaled router: logits and greedy ids."""
    from framework.testing import PARITY_PROMPTS, check_greedy_parity, check_logits_parity

    llm = check_logits_parity(*tiny_moe, PARITY_PROMPTS)
    _, reference = tiny_moe
    for ours, theirs in zip(llm.engine.core.runner.model.model.layers, reference.model.layers, strict=True):
        assert torch.equal(ours.moe.experts.w13_weight, theirs.experts.gate_up_proj)
        assert torch.equal(ours.moe.router.per_expert_scale, theirs.router.per_expert_scale)
    check_greedy_parity(*tiny_moe, PARITY_PROMPTS)


def test_layers_take_the_shapes_transformers_gives_them(tiny):
    path, reference = tiny
    model = LLM(str(path), num_blocks=16).engine.core.runner.model
    config, modes = reference.config, reference.config.kv_sharing_modes
    for index, (ours, theirs) in enumerate(zip(model.model.layers, reference.model.layers, strict=True)):
        attention = ours.self_attn.attn.config
        assert attention.head_size == theirs.self_attn.head_dim
        assert attention.num_kv_heads * theirs.self_attn.num_key_value_groups == config.num_attention_heads
        assert ours.layer.kv_mode == modes[index] or (modes[index] is None and ours.layer.kv_mode is None)
        assert ours.mlp.gate_up_proj.weight.shape[0] == 2 * theirs.mlp.intermediate_size
        assert torch.equal(ours.layer_scalar, theirs.layer_scalar)
        assert ours.moe is None
    assert len({layer.self_attn.attn.config.head_size for layer in model.model.layers}) == 2


@pytest.fixture(scope="module")
def tiny_multimodal(tmp_path_factory):
    """A Gemma 4 multimodal checkpoint (text model under ``model.language_model.``, a one-layer
    vision tower) written by transformers."""
    text = CONFIGS["gemma4_shared_kv_per_layer_inputs"]().to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    path = tmp_path_factory.mktemp("gemma4_multimodal")
    return path, write_randomised(path, config)


def test_multimodal_checkpoint_serves_its_text_model(tiny_multimodal, caplog):
    """Gemma4ForConditionalGeneration's logits (token prompts, chunked prefill) equal
    transformers' multimodal class's; its vision tensors are skipped with one log line."""
    import logging

    from framework.testing import PARITY_PROMPTS, check_logits_parity

    path, reference = tiny_multimodal
    assert type(reference).__name__ == "Gemma4ForConditionalGeneration"
    with caplog.at_level(logging.INFO, logger="fw.loader"):
        check_logits_parity(path, reference, PARITY_PROMPTS)
    num_encoder = sum(1 for name, _ in reference.named_parameters() if "language_model" not in name)
    skipped = [record.getMessage() for record in caplog.records if "encoder" in record.getMessage()]
    assert len(skipped) == 1 and f"skipped {num_encoder} vision/audio" in skipped[0]


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gpu_fast_path_matches_transformers_with_cuda_graphs(tmp_path, name):
    """Triton attention over layers of two head sizes (16, 32), shared-KV layers, Triton fused_moe
    with GeGLU experts, CUDA-graphed decode steps: transformers' greedy ids (fp32)."""
    from framework.testing import PARITY_PROMPTS, check_greedy_parity, check_kernels_used, count_kernel_calls

    reference = write_randomised(tmp_path, CONFIGS[name]())
    with count_kernel_calls() as calls:
        llm = LLM(str(tmp_path), device="cuda", dtype="f32", num_blocks=64)
        assert "decode graphs" in llm.engine.summary["cuda_graphs"]
        check_greedy_parity(
            tmp_path,
            reference,
            PARITY_PROMPTS,
            device="cuda",
            dtype="f32",
            prefill_chunk_size=64,
            max_num_batched_tokens=128,
        )
    check_kernels_used(calls, {"attention": "triton", **({"fused_moe": "triton"} if "moe" in name else {})})
