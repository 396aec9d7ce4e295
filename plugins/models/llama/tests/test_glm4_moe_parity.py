"""GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``) through the whole engine match transformers
(fp32, tiny random models written as released: random score-correction biases, an MTP layer).

The config keeps every switch live: GQA (4 query heads, 2 KV heads), q/k/v bias without an
o_proj bias, the RMS QK norm, NeoX rotary on half of each head, a dense first layer, then the
sigmoid router (2 groups, 1 kept) with shared experts and ``routed_scaling_factor``.
"""

from __future__ import annotations

import pytest
import transformers

from framework import LLM, SamplingParams
from framework.testing import (
    PARITY_PROMPTS,
    ModelParityTests,
    check_greedy_parity,
    check_kernels_used,
    count_kernel_calls,
    reference_greedy,
    tiny_model_fixture,
    write_grouped_moe_model,
)

CONFIGS = {
    "glm4_moe_qk_norm_bias": lambda: transformers.Glm4MoeConfig(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
        attention_bias=True,
        max_position_embeddings=512,
        initializer_range=0.1,
    ),
}

pytestmark = pytest.mark.usefixtures("one_thread")

tiny = tiny_model_fixture(CONFIGS, write=write_grouped_moe_model)


class TestParity(ModelParityTests):
    """Logits and greedy ids against transformers: batched chunked prefill, a prefix-cache hit, preemption."""


def test_layers_are_built_as_the_config_says(tiny):
    """Dense first layer, MoE after; the MTP layer is not built; no o_proj bias; QK norm; half the head rotates."""
    path, _ = tiny
    model = LLM(str(path), num_blocks=8).engine.core.runner.model
    layers = model.model.layers
    assert len(layers) == 2 and not hasattr(layers[0].mlp, "experts") and hasattr(layers[1].mlp, "experts")
    attention = layers[1].self_attn
    assert attention.qkv_proj.bias is not None and attention.o_proj.bias is None
    assert attention.q_norm is not None and attention.rotary_emb.rotary_dim == 8
    assert layers[1].mlp.gate.e_score_correction_bias.abs().min() > 0


def test_tensor_parallel_2_greedy_ids_match_transformers(tiny):
    """TP=2 on CPU (gloo): heads and every expert's features split, the MoE block's all-reduce
    deferred to the next norm."""
    path, reference = tiny
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = PARITY_PROMPTS[:2]
    with LLM(str(path), num_blocks=16, prefill_chunk_size=8, tensor_parallel_size=2) as llm:
        layers = llm.engine.core.runner.model.model.layers
        assert layers[1].self_attn.qkv_proj.num_heads == 2 and layers[1].mlp.reduce_results is False
        ids = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    assert ids == [reference_greedy(reference, prompt, greedy.max_tokens) for prompt in prompts]


@pytest.mark.gpu
def test_gpu_fast_path_matches_transformers_with_cuda_graphs(tmp_path):
    """Triton fused_moe, the fused QK-norm rotary over half of each head, Triton attention and
    CUDA-graphed decode give transformers' greedy ids (fp32)."""
    reference = write_grouped_moe_model(tmp_path, CONFIGS["glm4_moe_qk_norm_bias"]())
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
