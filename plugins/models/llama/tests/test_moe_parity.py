"""Mixtral, Qwen2-MoE and Qwen3-MoE through the whole engine match transformers (fp32, tiny random models).

Logits of a batch of mixed-length prompts at every position (chunked prefill, paged cache), and
32 greedy tokens. The tiny configs keep every switch live: top-2 of 8 experts, renormalised or
not, a shared expert, a dense layer among sparse ones (``mlp_only_layers``, ``decoder_sparse_step``).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from framework import LLM, SamplingParams
from framework.errors import ModelLoadError
from framework.testing import (
    PARITY_PROMPTS,
    ModelParityTests,
    check_greedy_parity,
    check_kernels_used,
    count_kernel_calls,
    tiny_model_fixture,
    write_tiny_model,
)

SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
QWEN_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96)

CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        **SMALL, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2
    ),
    # layer 1 dense (mlp_only_layers), the others sparse; top-k weights not renormalised
    "qwen2_moe_shared_expert": lambda: transformers.Qwen2MoeConfig(
        **SMALL, **QWEN_MOE, shared_expert_intermediate_size=40, norm_topk_prob=False, mlp_only_layers=[1]
    ),
    # every second layer sparse (decoder_sparse_step=2); renormalised top-k; QK norm; head_dim != hidden/heads
    "qwen3_moe_qk_norm": lambda: transformers.Qwen3MoeConfig(
        **SMALL, **QWEN_MOE, head_dim=32, norm_topk_prob=True, decoder_sparse_step=2
    ),
}


tiny = tiny_model_fixture(CONFIGS)


class TestParity(ModelParityTests):
    """Logits and greedy ids against transformers: batched chunked prefill, a prefix-cache hit, preemption."""


def test_layers_get_the_feed_forward_the_config_asks_for(tiny):
    path, reference = tiny
    model = LLM(str(path), num_blocks=16).engine.core.runner.model
    for ours, theirs in zip(model.model.layers, reference.model.layers, strict=True):
        hf_mlp = getattr(theirs, "mlp", None) or theirs.block_sparse_moe
        is_sparse = hasattr(hf_mlp, "experts")
        assert hasattr(ours.mlp, "experts") == is_sparse
        if is_sparse:
            # the stacked expert weights are transformers' own stacked tensors
            assert torch.equal(ours.mlp.experts.w13_weight, hf_mlp.experts.gate_up_proj)
            assert torch.equal(ours.mlp.experts.w2_weight, hf_mlp.experts.down_proj)


def test_checkpoint_stores_experts_one_by_one(tiny):
    """The tests load real checkpoint layouts (per-expert tensors), not transformers 5's stacked ones."""
    path, _ = tiny
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert any(".experts.0." in name for name in names), sorted(names)[:20]


def test_missing_expert_tensor_fails_naming_the_layer_and_expert(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = tiny
    weights = load_file(str(path / "model.safetensors"))
    dropped = next(
        name for name in sorted(weights) if name.endswith((".experts.3.up_proj.weight", ".experts.3.w3.weight"))
    )
    del weights[dropped]
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / file).write_text((path / file).read_text())
    save_file(weights, str(tmp_path / "model.safetensors"))
    layer = dropped.split(".experts.")[0].replace(".block_sparse_moe", ".mlp")
    with pytest.raises(ModelLoadError, match=rf"{layer}\.experts\.up \(w13_weight\) of expert\(s\) 3"):
        LLM(str(tmp_path), num_blocks=16)


def test_dummy_weights_load_through_transformers_stacked_names(tiny, tmp_path):
    """``--load-format dummy`` yields transformers 5's stacked ``experts.gate_up_proj`` names."""
    path, _ = tiny
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    llm = LLM(str(tmp_path), load_format="dummy", num_blocks=16)
    out = llm.generate(
        {"prompt_token_ids": PARITY_PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.gpu
def test_gpu_fast_path_matches_transformers_with_cuda_graphs(tmp_path):
    """Triton fused_moe (both alignment paths: batch 1 decode and a 64-token prefill chunk) and
    CUDA-graphed decode steps give transformers' greedy ids (fp32); fused_moe, the norms, rotary,
    SwiGLU (the dense layer) and attention all ran in Triton (a fallback to torch fails)."""
    reference = write_tiny_model(tmp_path, CONFIGS["qwen3_moe_qk_norm"]())
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
    check_kernels_used(
        calls,
        dict.fromkeys(
            ["fused_moe", "rms_norm", "fused_add_rms_norm", "qk_norm_rotary_embedding", "silu_and_mul", "attention"],
            "triton",
        ),
    )
