"""Tensor parallelism (TP=2 on CPU, gloo) for the hybrid models: each rank keeps half the attention
and DeltaNet heads (with their conv channels and states), half of every MLP and expert; the greedy
ids of a batch with chunked prefill must equal transformers'."""

from __future__ import annotations

import transformers

from framework import LLM, SamplingParams
from framework.testing import PARITY_PROMPTS, reference_greedy, write_randomised_model

SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    max_position_embeddings=512,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
#: the split projections (in_proj_qkv as three column shards, the conv channels of each), gated
#: attention and the MoE with its shared expert, all sharded. (Qwen3-Next's fused in_proj_qkvz is a
#: plain contiguous column split, by whole key-head groups.)
CONFIG = dict(
    **SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40
)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_tp2_qwen3_5_moe_greedy_ids_match_transformers(tmp_path):
    reference = write_randomised_model(tmp_path, transformers.Qwen3_5MoeTextConfig(**CONFIG))
    prompts = [PARITY_PROMPTS[0], PARITY_PROMPTS[2]]
    with LLM(str(tmp_path), device="cpu", num_blocks=32, prefill_chunk_size=8, tensor_parallel_size=2) as llm:
        assert llm.engine.summary["tensor_parallel_size"] == 2
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.outputs[0].token_ids == reference_greedy(reference, prompt, GREEDY.max_tokens)
