"""Tiny random models quantized by the test's own writer into the exact Hugging Face block-FP8
layout, loaded by transformers (which dequantizes FP8 on the CPU) and by fw: the same greedy
tokens; also a MoE (Qwen3-MoE experts, per-expert block scales), tensor parallelism, the
compressed-tensors channel / tensor layouts, and ``--quantization fp8`` on a 16-bit checkpoint."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_fp8_checkpoints import quantize_checkpoint

from framework import LLM, SamplingParams
from framework.testing import interpreted, reference_greedy, write_grouped_moe_model, write_tiny_model

# 4 heads of 32 and 2 KV heads: q is one 128-row block, k and v 64 rows each (blocks that do not
# start on 128-row boundaries inside the fused qkv_proj)
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
MOE = dict(
    vocab_size=160,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    initializer_range=0.1,
)
# DeepSeek-V3's layout: MLA projections (kv_b_proj too), dense first layer, routed and shared experts
DEEPSEEK_V3 = dict(
    vocab_size=160,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=64,
    q_lora_rank=96,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)
PROMPTS = [[5, 9, 33, 2, 71], list(range(40, 59))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def greedy(path, **engine_args) -> list[list[int]]:
    with LLM(str(path), device="cpu", dtype="float32", num_blocks=16, **engine_args) as llm:
        return [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


def transformers_greedy(path) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return [reference_greedy(model.eval(), p, GREEDY.max_tokens) for p in PROMPTS]


def test_block_fp8_llama_matches_transformers_loading_the_same_files(tmp_path):
    write_tiny_model(tmp_path, transformers.LlamaConfig(**CONFIG))
    quantize_checkpoint(tmp_path, "block")
    assert greedy(tmp_path) == transformers_greedy(tmp_path)


def test_block_fp8_llama_under_tensor_parallelism_matches_transformers(tmp_path):
    # each of 2 ranks: 128 of o_proj's and 256 of down_proj's inputs (whole blocks), 32 rows of k and v
    write_tiny_model(
        tmp_path,
        transformers.LlamaConfig(**{**CONFIG, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8}),
    )
    quantize_checkpoint(tmp_path, "block")
    assert greedy(tmp_path, tensor_parallel_size=2) == transformers_greedy(tmp_path)


def test_block_fp8_moe_experts_match_transformers(tmp_path):
    write_tiny_model(tmp_path, transformers.Qwen3MoeConfig(**MOE))
    quantize_checkpoint(tmp_path, "block")
    assert greedy(tmp_path) == transformers_greedy(tmp_path)


def test_block_fp8_deepseek_v3_absorbs_its_dequantized_kv_b_proj(tmp_path, monkeypatch):
    """DeepSeek-V3/R1 as released: every projection block-FP8, kv_b_proj included; MLA multiplies by
    kv_b_proj's weight directly, so fw dequantizes it once after loading (the MTP layer is skipped).
    The layers take the CPU's torch path: the Triton kernels under the interpreter (ten times slower
    here) are the other tests' subject."""
    monkeypatch.setattr("fw_fp8.kernels.dispatch.interpreting", lambda: False)
    write_grouped_moe_model(tmp_path, transformers.DeepseekV3Config(**DEEPSEEK_V3))
    quantize_checkpoint(tmp_path, "block")
    with LLM(str(tmp_path), device="cpu", dtype="float32", num_blocks=16) as llm:
        attention = llm.engine.core.runner.model.model.layers[0].self_attn
        assert type(attention.kv_b_proj.linear_method).__name__ == "Fp8LinearMethod"
        assert attention.kv_b_is_quantized and attention.kv_b_dequantized.dtype == torch.float32
        ids = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    assert ids == transformers_greedy(tmp_path)


@pytest.mark.parametrize(("granularity", "static_inputs"), [("channel", False), ("tensor", True)])
def test_compressed_tensors_fp8_matches_transformers_on_the_dequantized_weights(granularity, static_inputs, tmp_path):
    reference = write_tiny_model(tmp_path, transformers.LlamaConfig(**CONFIG))
    dense = quantize_checkpoint(tmp_path, granularity, static_inputs)
    state = reference.state_dict()
    for name, value in dense.items():
        state[name].copy_(value)
    assert greedy(tmp_path) == [reference_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS]


def test_quantization_fp8_on_a_16_bit_checkpoint_quantizes_every_linear_layer_at_load(tmp_path):
    from fp8_reference import dequantize_reference, quantize_reference

    reference = write_tiny_model(tmp_path, transformers.LlamaConfig(**CONFIG))
    state = reference.state_dict()
    for name, value in state.items():  # what block quantization at load makes of each weight
        if name.endswith("proj.weight"):
            value.copy_(dequantize_reference(*quantize_reference(value, "block"), "block"))
    with LLM(str(tmp_path), device="cpu", dtype="float32", num_blocks=16, quantization="fp8") as llm:
        layer = llm.engine.core.runner.model.model.layers[0].mlp.down_proj
        assert layer.fp8_qweight.dtype == torch.float8_e4m3fn and not hasattr(layer, "weight")
        got = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    assert got == [reference_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS]


@interpreted
def test_block_fp8_moe_experts_through_the_triton_kernel_match_transformers(tmp_path, monkeypatch):
    """The engine's MoE layers on fw_fp8's Triton ``quantized_fused_moe`` (interpreted here and forced
    by ``FW_KERNELS``; CUDA picks it itself): the greedy tokens transformers gives on the same files."""
    from framework.layers.fused_moe import FusedMoE

    monkeypatch.setenv("FW_KERNELS", "quantized_fused_moe=triton_fp8")
    write_tiny_model(tmp_path, transformers.Qwen3MoeConfig(**{**MOE, "num_hidden_layers": 1}))
    quantize_checkpoint(tmp_path, "block")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(str(tmp_path), device="cpu", dtype="float32", num_blocks=16) as llm:
        experts = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
        assert experts and all(e.quant_method.fused_moe.__module__ == "fw_fp8.kernels.moe" for e in experts)
        ids = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    )
    assert ids == [reference_greedy(model.eval(), PROMPTS[0], params.max_tokens)]
