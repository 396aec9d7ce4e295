"""DeepSeek-V3 / R1 and GLM-4.7-Flash through the whole engine match transformers (fp32, tiny
random models written as released: random score-correction biases, an MTP layer appended).

DeepSeek-V3: 4 groups of 2 experts with 2 kept, ``routed_scaling_factor`` 2.5, YaRN with
DeepSeek's mscale, rotary on interleaved pairs. GLM-4.7-Flash: one group, ``mlp_layer_types``,
rotary on halves (``rope_interleave`` false). Logits of mixed-length prompts at every position
with chunked prefill, 32 greedy tokens, the same after a prefix-cache hit and after preemption.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from framework import LLM
from framework.testing import ModelParityTests, tiny_model_fixture, write_grouped_moe_model

SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,  # the configs default to 128 / 20; MLA ignores it, transformers divides by it
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    max_position_embeddings=512,
    initializer_range=0.1,
)

CONFIGS = {
    "deepseek_v3_grouped_yarn": lambda: transformers.DeepseekV3Config(
        **SMALL,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    "glm4_moe_lite_halves": lambda: transformers.Glm4MoeLiteConfig(
        **SMALL,
        mlp_layer_types=["dense", "sparse"],
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.8,
        rope_interleave=False,
    ),
}

pytestmark = pytest.mark.usefixtures("one_thread")

tiny = tiny_model_fixture(CONFIGS, write=write_grouped_moe_model)


class TestParity(ModelParityTests):
    """Logits and greedy ids against transformers: batched chunked prefill, a prefix-cache hit, preemption."""


def test_mtp_layer_is_skipped_and_the_latent_cached(tiny):
    """The checkpoint's extra layer is not built (and loading did not fail on its tensors); the
    cache holds kv_lora_rank + qk_rope_head_dim numbers per token and layer."""
    from safetensors import safe_open

    path, reference = tiny
    with safe_open(path / "model.safetensors", "pt") as f:
        assert any(name.startswith("model.layers.2.") for name in f.keys())
    llm = LLM(str(path), num_blocks=8)
    model = llm.engine.core.runner.model
    assert len(model.model.layers) == SMALL["num_hidden_layers"]
    assert [tuple(c.data.shape[1:]) for c in llm.engine.core.runner.kv_caches] == [(16, 40)] * 2
    gate = model.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.abs().min() > 0  # the written (random) bias, loaded


def test_tensor_parallel_2_greedy_ids_match_transformers(tmp_path):
    """TP=2 on CPU (gloo): each rank computes half the heads and half of every expert's features;
    the routers are replicated, so both ranks choose the same experts."""
    from framework import SamplingParams
    from framework.testing import PARITY_PROMPTS, reference_greedy

    reference = write_grouped_moe_model(tmp_path, CONFIGS["deepseek_v3_grouped_yarn"]())
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = PARITY_PROMPTS[:2]
    with LLM(str(tmp_path), num_blocks=16, prefill_chunk_size=8, tensor_parallel_size=2) as llm:
        assert llm.engine.core.runner.model.model.layers[0].self_attn.num_heads == SMALL["num_attention_heads"] // 2
        ids = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    assert ids == [reference_greedy(reference, prompt, greedy.max_tokens) for prompt in prompts]


@pytest.mark.gpu
def test_greedy_tokens_match_transformers_on_cuda(tiny):
    """On the GPU: the Triton backend over the MLA cache, the registry's Triton fused_moe fed by the
    grouped top-k router, fp32, against transformers on the CPU (a fallback to torch fails)."""
    from framework import SamplingParams
    from framework.testing import PARITY_PROMPTS, check_kernels_used, count_kernel_calls, reference_greedy

    path, reference = tiny
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with count_kernel_calls() as calls:
        llm = LLM(str(path), device="cuda", dtype="float32", num_blocks=64, prefill_chunk_size=8)
        results = llm.generate([{"prompt_token_ids": p} for p in PARITY_PROMPTS], greedy)
    for prompt, result in zip(PARITY_PROMPTS, results, strict=True):
        assert result.outputs[0].token_ids == reference_greedy(reference, prompt)
    check_kernels_used(calls, {"fused_moe": "triton", "rms_norm": "triton", "attention": "triton"})


def test_glm4_moe_lite_without_mlp_layer_types_takes_transformers_default(tmp_path):
    """A GLM-4.7-Flash config.json without ``mlp_layer_types``: transformers makes the first layer
    dense and the others MoE (whatever ``first_k_dense_replace`` says), and so does fw."""
    import json
    import shutil

    from framework.testing import check_logits_parity

    reference = write_grouped_moe_model(tmp_path / "written", CONFIGS["glm4_moe_lite_halves"]())
    shutil.copytree(tmp_path / "written", tmp_path / "edited")
    config = json.loads((tmp_path / "edited" / "config.json").read_text())
    del config["mlp_layer_types"]
    config["first_k_dense_replace"] = 0  # not read by transformers' Glm4MoeLite
    (tmp_path / "edited" / "config.json").write_text(json.dumps(config))
    assert transformers.AutoConfig.from_pretrained(tmp_path / "edited").mlp_layer_types == ["dense", "sparse"]
    llm = check_logits_parity(tmp_path / "edited", reference, [list(range(40, 53))])
    layers = llm.engine.core.runner.model.model.layers
    assert [hasattr(layer.mlp, "experts") for layer in layers] == [False, True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_on_two_gpus_gives_the_greedy_ids_of_transformers(tmp_path):
    """NCCL, the registry's fused_moe kernel on each rank's expert slices, the grouped router replicated, fp32."""
    from framework import SamplingParams
    from framework.testing import PARITY_PROMPTS, reference_greedy

    reference = write_grouped_moe_model(tmp_path, CONFIGS["deepseek_v3_grouped_yarn"]())
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(str(tmp_path), device_ids=[0, 1], dtype="float32", num_blocks=64, prefill_chunk_size=8) as llm:
        assert llm.engine.summary["tensor_parallel_size"] == 2
        results = llm.generate([{"prompt_token_ids": p} for p in PARITY_PROMPTS], greedy)
    assert [r.outputs[0].token_ids for r in results] == [reference_greedy(reference, p, 10) for p in PARITY_PROMPTS]
