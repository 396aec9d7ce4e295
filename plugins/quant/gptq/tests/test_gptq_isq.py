"""``--isq int4`` / ``int8``: a tiny random bf16 Llama quantized at load into the GPTQ layout (group
128, symmetric, round to nearest) generates the greedy tokens transformers generates on the
weights that rounding stands for (computed here independently, in a few lines)."""

from __future__ import annotations

import pytest
import torch
import transformers
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


def rounded(weight: torch.Tensor, bits: int, group: int = 128) -> torch.Tensor:
    """Symmetric round-to-nearest per group of ``group`` inputs, fp16 scales: the values it stands for."""
    rows, cols = weight.shape
    w = weight.float().reshape(rows, cols // group, group)
    top = 2 ** (bits - 1)
    scale = (w.abs().amax(-1, keepdim=True) / (top - 1)).clamp_min(1e-8).half().float()
    q = (torch.round(w / scale) + top).clamp(0, 2 * top - 1)
    return ((q - top) * scale).reshape(rows, cols)


@pytest.mark.parametrize(("isq", "bits"), [("int4", 4), ("int8", 8)])
def test_isq_int_tiny_llama_matches_transformers_on_rounded_weights(isq, bits, tmp_path):
    reference = write_tiny_model(tmp_path, transformers.LlamaConfig(**CONFIG, torch_dtype="bfloat16"))
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    state = {}
    for name, tensor in tensors.items():
        is_linear = name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS
        state[name] = rounded(tensor, bits) if is_linear else tensor.float()
    reference.load_state_dict(state, strict=False)
    expected = [reference_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS]
    with LLM(str(tmp_path), device="cpu", dtype="float32", num_blocks=16, isq=isq) as llm:
        assert llm.engine.summary["isq"].startswith(f"--isq {isq}: quantized 14 tensors")  # 7 linears x 2 layers
        assert (
            type(llm.engine.core.runner.model.model.layers[0].mlp.down_proj.quant_method).__name__
            == "WNA16LinearMethod"
        )
        results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [r.outputs[0].token_ids for r in results] == expected
