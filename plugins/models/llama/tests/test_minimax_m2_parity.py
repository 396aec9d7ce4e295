"""MiniMax-M2 through the whole engine matches transformers (fp32, tiny random model).

The routing bias (``e_score_correction_bias``, zeros in a fresh model) is drawn at the scale of
the sigmoid scores so that it changes which experts are chosen; the norms are randomised so the
QK norm across heads counts; a quarter of each head rotates (``rotary_dim``).

The tiny config states the partial rotary twice, as ``rotary_dim`` (MiniMax's own field, which fw
reads) and as ``partial_rotary_factor``: transformers 5.17 (the GPU machine's) ignores ``rotary_dim``
and rotates every feature of the head, while 5.24 maps it onto the factor, so a reference built
from ``rotary_dim`` alone would be another model under 5.17. :func:`write_with_routing_bias`
checks that the reference rotates ``rotary_dim`` features; ``test_minimax_config_json_with_rotary_dim_only``
covers checkpoints with ``rotary_dim`` alone.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from framework import LLM, SamplingParams
from framework.testing import (
    PARITY_PROMPTS,
    ModelParityTests,
    capture_logits,
    check_kernels_used,
    count_kernel_calls,
    interpreted,
    reference_logits,
    require_triton,
    tiny_model_fixture,
    write_tiny_model,
)
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
        partial_rotary_factor=0.25,  # the same 8 features, for transformers that ignore rotary_dim
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=1,
    )
}


def write_with_routing_bias(path, config):
    """A tiny MiniMax-M2 with random norms and a random routing bias (N(0, 0.3)), whose transformers
    reference rotates ``rotary_dim`` features of each head, as fw does."""
    reference = write_tiny_model(path, config)
    rotated = 2 * reference.model.rotary_emb.inv_freq.numel()
    assert rotated == config.rotary_dim, (
        f"transformers {transformers.__version__} rotates {rotated} features per head, not rotary_dim="
        f"{config.rotary_dim}: its reference is not the model fw serves"
    )
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

    from framework.testing import check_logits_parity

    path, reference = tiny
    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    assert config["rotary_dim"] == 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    for file in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / file).symlink_to(path / file)
    check_logits_parity(tmp_path, reference, PARITY_PROMPTS[:2])


def check_generated_logits(path, reference, steps: int, **engine_args) -> None:
    """``steps`` greedy ids of :data:`PARITY_PROMPTS` through ``LLM(path, **engine_args)``: every logit
    the engine computes, at prompt and decode positions, is transformers' within 1e-4 of the largest,
    and each id is the argmax of transformers' logits after the ids before it (so the ids are
    transformers' greedy ids). Logits see what ids alone may not: the renormalised routing weights
    sit near 0.5 in this tiny model, so a kernel that ignored them would keep most greedy ids."""
    llm = LLM(str(path), num_blocks=64, prefill_chunk_size=64, max_num_batched_tokens=128, **engine_args)
    records = capture_logits(llm)
    results = llm.generate(
        [{"prompt_token_ids": p} for p in PARITY_PROMPTS],
        SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True),
    )
    for index, (prompt, result) in enumerate(zip(PARITY_PROMPTS, results, strict=True)):
        ids = result.outputs[0].token_ids
        seen = [*prompt, *ids[:-1]]
        expected = reference_logits(reference, seen)
        got = torch.stack([records[(f"{index}-0", pos)].cpu() for pos in range(len(seen))])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * expected.abs().max().item())
        assert ids == expected[len(prompt) - 1 :].argmax(dim=-1).tolist(), f"prompt {index}"


@interpreted
def test_triton_fused_moe_takes_the_bias_corrected_routing(tiny, monkeypatch):
    """The GPU test's engine shapes on CPU with the Triton fused_moe interpreted: the sigmoid
    router's float32 weights and int32 ids through the grouped GEMMs, in a 47-token prefill (the
    device sort) and decode steps of 3 tokens (the one-program sort), give transformers' logits."""
    require_triton()
    path, reference = tiny
    monkeypatch.setenv("FW_KERNELS", "fused_moe=triton")
    with count_kernel_calls() as calls:
        check_generated_logits(path, reference, steps=8, dtype="f32")
    check_kernels_used(calls, {"fused_moe": "triton"})


@pytest.mark.gpu
def test_gpu_fast_path_matches_transformers_with_cuda_graphs(tmp_path):
    """Triton attention and fused_moe with CUDA-graphed decode steps give transformers' logits and
    greedy ids (fp32: the kernels' dots are IEEE float32, cuBLAS runs without TF32)."""
    reference = write_with_routing_bias(tmp_path, CONFIGS["minimax_m2"]())
    with count_kernel_calls() as calls:
        llm = LLM(str(tmp_path), device="cuda", dtype="f32", num_blocks=64)
        assert "decode graphs" in llm.engine.summary["cuda_graphs"]
        check_generated_logits(tmp_path, reference, steps=32, device="cuda", dtype="f32")
    check_kernels_used(calls, {"attention": "triton", "fused_moe": "triton"})
