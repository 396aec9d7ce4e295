"""``--isq fp8``: a tiny random bf16 Llama quantized at load into 128x128 block FP8 (the
``weight`` + ``weight_scale_inv`` a block-FP8 checkpoint holds) generates the greedy tokens
transformers generates on the weights those blocks stand for."""

from __future__ import annotations

import torch
import transformers
from fw_fp8.quantize import dequantize_block_fp8, quantize_weight_fp8
from safetensors.torch import load_file, save_file

from framework import LLM, SamplingParams
from framework.testing import reference_greedy, write_tiny_model

CONFIG = dict(
    vocab_size=160,
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)
PROMPTS = [[5, 9, 33, 2, 71], list(range(40, 59))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_isq_fp8_tiny_llama_matches_transformers_on_the_block_fp8_values(tmp_path):
    reference = write_tiny_model(tmp_path, transformers.LlamaConfig(**CONFIG, torch_dtype="bfloat16"))
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    state = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
            tensor = dequantize_block_fp8(*quantize_weight_fp8(tensor))
        state[name] = tensor.float()
    reference.load_state_dict(state, strict=False)
    expected = [reference_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS]
    with LLM(str(tmp_path), device="cpu", dtype="float32", num_blocks=16, isq="fp8") as llm:
        assert llm.engine.summary["isq"].startswith("--isq fp8: quantized 14 tensors")
        results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [r.outputs[0].token_ids for r in results] == expected
