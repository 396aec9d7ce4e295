"""NVFP4 (modelopt, compressed-tensors) and compressed-tensors MXFP4 MoE experts, one tensor set per
expert as released checkpoints store them: a tiny Qwen3-MoE through the whole engine (the CPU's
torch path: packed experts decoded per step) against transformers on the packer's exact
dequantized weights. The kernel itself: test_fp4_conformance's interpreted MoE kit."""

from __future__ import annotations

import pytest
import torch
from tiny_fp4_llama import LAYOUTS
from tiny_fp4_moe import write_fp4_qwen3_moe

from framework import SamplingParams
from framework.testing import PARITY_PROMPTS, check_logits_parity
from framework.testing.parity import reference_greedy


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_ids_and_logits_match_transformers_on_the_dequantized_weights(layout, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reference = write_fp4_qwen3_moe(tmp_path, layout)
    prompts = PARITY_PROMPTS[:2]
    llm = check_logits_parity(tmp_path, reference, prompts)
    experts = llm.engine.core.runner.model.model.layers[0].mlp.experts
    assert type(experts.quant_method).__name__ == "Fp4ExpertsMethod" and experts.fp4_w13.dtype == torch.uint8
    assert experts.fp4_w13.shape == (8, 128, 32)  # gate and up rows of every expert, K/2 bytes each
    steps = 8
    results = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    )
    for prompt, result in zip(prompts, results, strict=True):
        assert result.outputs[0].token_ids == reference_greedy(reference, prompt, steps)
