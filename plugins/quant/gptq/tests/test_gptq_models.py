"""Tiny random Llama models in every format (written by the independent writers) generate, through
the engine, the greedy tokens transformers generates on the dequantized weights: on one device and
with tensor parallelism over two CPU processes."""

from __future__ import annotations

import pytest
import torch
import transformers
from schemes import FormatScheme
from tiny_checkpoints import quantize_checkpoint

from framework import LLM, SamplingParams
from framework.testing import interpreted, reference_greedy, write_tiny_model

CONFIG = dict(
    vocab_size=160,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)
PROMPTS = [[5, 9, 33, 2, 71], list(range(40, 59))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

MODELS = [
    FormatScheme("gptq", 4, 128),
    FormatScheme("gptq", 4, 32, symmetric=False, act_order=True),
    FormatScheme("gptq", 8, 64, symmetric=False, v2=True),
    FormatScheme("awq", 4, 64, symmetric=False),
    FormatScheme("compressed", 4, 32, symmetric=False),
    FormatScheme("compressed", 8, -1),
    FormatScheme("marlin", 4, 128),
]


def greedy(path, **engine_args) -> list[list[int]]:
    with LLM(str(path), device="cpu", dtype="float32", num_blocks=16, **engine_args) as llm:
        return [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


@pytest.mark.parametrize("scheme", MODELS, ids=repr)
def test_quantized_tiny_model_matches_transformers_on_dequantized_weights(scheme, tmp_path):
    reference = write_tiny_model(tmp_path, transformers.LlamaConfig(**CONFIG))
    quantize_checkpoint(tmp_path, reference, scheme)
    expected = [reference_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS]
    assert greedy(tmp_path) == expected


@pytest.mark.parametrize(
    "scheme",
    [FormatScheme("gptq", 4, 32, symmetric=False, act_order=True), FormatScheme("awq", 4, 64, symmetric=False)],
    ids=repr,
)
def test_quantized_tiny_model_under_tensor_parallelism_matches_transformers(scheme, tmp_path):
    reference = write_tiny_model(tmp_path, transformers.LlamaConfig(**CONFIG))
    quantize_checkpoint(tmp_path, reference, scheme)
    expected = [reference_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS]
    assert greedy(tmp_path, tensor_parallel_size=2) == expected


def test_a_checkpoint_that_needs_packing_is_kept_packed_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv("FW_GPTQ_KEEP_PACKED", "1")
    reference = write_tiny_model(tmp_path, transformers.LlamaConfig(**CONFIG))
    quantize_checkpoint(tmp_path, reference, FormatScheme("gptq", 4, 128))
    with LLM(str(tmp_path), device="cpu", dtype="float32", num_blocks=16) as llm:
        layer = llm.engine.core.runner.model.model.layers[0].self_attn.qkv_proj
        assert layer.wna16_qweight.dtype == torch.int32 and layer.wna16_dense is None
        results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [r.outputs[0].token_ids for r in results] == [reference_greedy(reference, p, 10) for p in PROMPTS]


MOE = dict(
    vocab_size=160,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


@pytest.mark.parametrize(
    ("scheme", "tp"),
    [
        (FormatScheme("gptq", 4, 32, symmetric=False, act_order=True), 2),
        (FormatScheme("awq", 4, 64, symmetric=False), 1),
    ],
    ids=repr,
)
def test_quantized_moe_experts_load_per_expert_and_match_transformers(scheme, tp, tmp_path, monkeypatch):
    monkeypatch.setenv("FW_GPTQ_KEEP_PACKED", "1")  # experts stay packed, run by quantized_fused_moe, as on the GPU
    reference = write_tiny_model(tmp_path, transformers.Qwen3MoeConfig(**MOE))
    quantize_checkpoint(tmp_path, reference, scheme)
    expected = [reference_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS]
    assert greedy(tmp_path, tensor_parallel_size=tp) == expected


@interpreted
def test_packed_moe_experts_through_the_triton_kernel_match_transformers(tmp_path, monkeypatch):
    """The engine's MoE layers on fw_gptq's Triton ``quantized_fused_moe`` (interpreted here and forced
    by ``FW_KERNELS``; CUDA picks it itself) over packed act-order experts with zero points: the greedy
    tokens transformers gives on the dequantized weights."""
    from framework.layers.fused_moe import FusedMoE

    monkeypatch.setenv("FW_GPTQ_KEEP_PACKED", "1")
    monkeypatch.setenv("FW_KERNELS", "quantized_fused_moe=triton_wna16")
    config = transformers.Qwen3MoeConfig(**{**MOE, "num_hidden_layers": 1})
    reference = write_tiny_model(tmp_path, config)
    quantize_checkpoint(tmp_path, reference, FormatScheme("gptq", 4, 32, symmetric=False, act_order=True))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(str(tmp_path), device="cpu", dtype="float32", num_blocks=16) as llm:
        experts = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
        assert experts and all(e.quant_method.fused_moe.__module__ == "fw_gptq.kernels.moe" for e in experts)
        # desc_act experts sorted by group at load: the kernel gathers the activations through perm
        assert {p.quant_type for e in experts for p in e.quant_method.packed_experts(e)} == {"wna16:4bit:perm32"}
        ids = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)]
    assert ids == [reference_greedy(reference, PROMPTS[0], params.max_tokens)]
