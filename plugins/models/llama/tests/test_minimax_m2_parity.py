"""MiniMax-M2 through the whole engine matches transformers (fp32, tiny random model).

The routing bias (``e_score_correction_bias``, zeros in a fresh model) is drawn at the scale of
the sigmoid scores so that it changes which experts are chosen; the norms are randomised so the
QK norm across heads counts; a quarter of each head rotates (``rotary_dim``).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from framework import LLM
from framework.testing import ModelParityTests, reference_logits, tiny_model_fixture, write_tiny_model
from framework.testing.model_writers import randomise_identity_params

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = {
    "minimax_m2": lambda: transformers.MiniMaxM2Config(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rotary_dim=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=1,
    )
}


def write_with_routing_bias(path, config):
    """A tiny MiniMax-M2 with random norms and a random routing bias (N(0, 0.3))."""
    reference = write_tiny_model(path, config)
    randomise_identity_params(reference)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in reference.model.layers:
            bias = layer.mlp.e_score_correction_bias
            bias.copy_(0.3 * torch.randn(bias.shape, generator=generator))
    reference.save_pretrained(path)
    return reference


tiny = tiny_model_fixture(CONFIGS, write=write_with_routing_bias)


class TestParity(ModelParityTests):
    """Logits and greedy ids against transformers: batched chunked prefill, a prefix-cache hit, preemption."""


def test_checkpoint_layout_and_loaded_router(tiny):
    """MiniMax's own names (block_sparse_moe, experts.{e}.w1/w3/w2) load; the bias arrives in float32."""
    path, reference = tiny
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in names
    model = LLM(str(path), num_blocks=16).engine.core.runner.model
    ours, theirs = model.model.layers[1], reference.model.layers[1]
    assert ours.mlp.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(ours.mlp.e_score_correction_bias, theirs.mlp.e_score_correction_bias)
    assert ours.self_attn.rotary_emb.rotary_dim == 8 and ours.self_attn.q_norm.weight.shape == (4 * 32,)


def test_routing_bias_changes_the_outputs(tiny):
    """Without the bias transformers' logits move beyond the parity tolerance, so parity pins it."""
    _, reference = tiny
    prompt = list(range(3, 40))
    base = reference_logits(reference, prompt)
    saved = [layer.mlp.e_score_correction_bias.clone() for layer in reference.model.layers]
    try:
        for layer in reference.model.layers:
            layer.mlp.e_score_correction_bias.zero_()
        unbiased = reference_logits(reference, prompt)
    finally:
        for layer, bias in zip(reference.model.layers, saved, strict=True):
            layer.mlp.e_score_correction_bias.copy_(bias)
    assert (unbiased - base).abs().max() > 1e-2 * base.abs().max()


def test_tensor_parallelism_is_refused_naming_the_reason(tiny):
    from framework.errors import ConfigError

    path, _ = tiny
    with pytest.raises(ConfigError, match="supports_tensor_parallel"):
        LLM(str(path), num_blocks=16, tensor_parallel_size=2)


def test_minimax_config_json_with_rotary_dim_only(tiny, tmp_path):
    """MiniMax's released config.json names the rotating features ``rotary_dim`` (no
    ``partial_rotary_factor``) and keeps ``rope_theta`` at the top level."""
    import json

    from framework.testing import PARITY_PROMPTS, check_logits_parity

    path, reference = tiny
    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    assert config["rotary_dim"] == 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    for file in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / file).symlink_to(path / file)
    check_logits_parity(tmp_path, reference, PARITY_PROMPTS[:2])


@pytest.mark.gpu
def test_gpu_fast_path_matches_transformers_with_cuda_graphs(tmp_path):
    """Triton attention and fused_moe with CUDA-graphed decode steps give transformers' greedy ids (fp32)."""
    from framework.testing import PARITY_PROMPTS, check_greedy_parity, check_kernels_used, count_kernel_calls

    reference = write_with_routing_bias(tmp_path, CONFIGS["minimax_m2"]())
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
    check_kernels_used(calls, {"attention": "triton", "fused_moe": "triton"})
