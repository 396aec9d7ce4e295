"""gpt-oss through the whole engine matches transformers (tiny random models).

fp32: logits at every position of batched chunked prefills and greedy ids (the shared parity
suite); bf16: logits as close to the fp32 ones as transformers' own bf16 logits. The tiny config keeps every gpt-oss switch live: sinks (random, as
transformers initialises them), a sliding layer with a window shorter than the prompts, YaRN,
a biased router choosing 2 of 8 experts, biased experts whose gate/up outputs reach the clamp.
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
    reference_logits,
    tiny_model_fixture,
    write_randomised_model,
)


def gpt_oss_config(**changes) -> transformers.GptOssConfig:
    """A tiny gpt-oss: 2 layers (sliding, full), 4 query / 2 KV heads of 16, 8 experts of width 32."""
    settings = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=512,
        initializer_range=0.1,
        swiglu_limit=1.5,  # low enough that the tiny model's projections are clamped
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
            "rope_theta": 150000.0,
        },
    )
    return transformers.GptOssConfig(**{**settings, **changes})


def write_gpt_oss(path, config: transformers.GptOssConfig):
    """A tiny random gpt-oss whose biases, norms, expert biases and sinks are all random (sinks
    ~N(0, 1), so they take a real share of each softmax); returns the fp32 reference."""
    model = write_randomised_model(path, config)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=generator))
            for bias in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
                bias.copy_(0.3 * torch.randn(bias.shape, generator=generator))
    model.save_pretrained(path, safe_serialization=True)
    return model


tiny = tiny_model_fixture({"gpt_oss": gpt_oss_config}, write=write_gpt_oss)


class TestParity(ModelParityTests):
    """Logits and greedy ids against transformers: batched chunked prefill, a prefix-cache hit, preemption."""


def test_layers_alternate_sliding_and_full_attention_with_sinks(tiny):
    path, reference = tiny
    model = LLM(str(path), num_blocks=16).engine.core.runner.model
    windows = [layer.self_attn.attn.config.sliding_window for layer in model.model.layers]
    assert windows == [8, None]
    for ours, theirs in zip(model.model.layers, reference.model.layers, strict=True):
        assert ours.self_attn.attn.config.has_sinks
        assert torch.equal(ours.self_attn.sinks, theirs.self_attn.sinks)
        # the interleaved [E, H, 2I] gate/up columns become FusedMoE's [E, gate rows | up rows, H]
        gate_up = theirs.mlp.experts.gate_up_proj.transpose(1, 2)
        assert torch.equal(ours.mlp.experts.w13_weight, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], 1))
        assert torch.equal(ours.mlp.experts.w2_weight, theirs.mlp.experts.down_proj.transpose(1, 2))
        bias = theirs.mlp.experts.gate_up_proj_bias
        assert torch.equal(ours.mlp.experts.w13_bias, torch.cat([bias[:, 0::2], bias[:, 1::2]], 1))


@pytest.fixture(scope="module")
def tiny_bf16(tiny):
    """The fp32 checkpoint, and transformers serving it in bf16 (its norms stay float32:
    ``_keep_in_fp32_modules``), beside the fp32 reference."""
    path, reference = tiny
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
    return path, reference, bf16.eval()


def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16(tiny_bf16):
    """In bf16 the two implementations round differently (fw attends in float32, transformers in
    bf16), so greedy ids of a tiny random model part at near-ties; what must hold is that fw's
    bf16 logits stray from the fp32 ones no more than transformers' own bf16 logits do."""
    path, reference, bf16 = tiny_bf16
    llm = LLM(str(path), dtype="bfloat16", num_blocks=64, prefill_chunk_size=8, max_num_batched_tokens=16)
    records = capture_logits(llm)
    llm.generate([{"prompt_token_ids": p} for p in PARITY_PROMPTS], SamplingParams(temperature=0, max_tokens=1))
    for index, prompt in enumerate(PARITY_PROMPTS):
        exact = reference_logits(reference, prompt)
        theirs = (reference_logits(bf16, prompt) - exact).abs().max().item()
        ours = (torch.stack([records[(f"{index}-0", pos)] for pos in range(len(prompt))]) - exact).abs().max().item()
        assert ours <= 2 * theirs, f"prompt {index}: fw bf16 error {ours:.3g}, transformers bf16 error {theirs:.3g}"
