"""Gemma 3 (QK norm, sliding window, tied and padded vocabulary) under tensor parallelism on CPU (gloo)
gives transformers' greedy ids."""

from __future__ import annotations

import torch
import transformers

from framework import LLM, SamplingParams
from framework.testing import reference_greedy, write_tiny_model

PROMPTS = [[5, 9, 33, 2, 71], list(range(40, 55))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_gemma3_tp2_greedy_ids_match_transformers(tmp_path):
    config = transformers.Gemma3TextConfig(
        vocab_size=161,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.1,
        num_hidden_layers=2,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,
    )
    reference = write_tiny_model(tmp_path, config)
    with torch.no_grad():  # transformers starts (1 + w) norms at w = 0; random ones make them count
        generator = torch.Generator().manual_seed(2)
        for name, param in reference.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    reference.save_pretrained(tmp_path, safe_serialization=True)
    with LLM(str(tmp_path), device="cpu", num_blocks=32, prefill_chunk_size=8, tensor_parallel_size=2) as llm:
        assert llm.engine.summary["tensor_parallel_size"] == 2
        results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.outputs[0].token_ids == reference_greedy(reference, prompt, GREEDY.max_tokens)
