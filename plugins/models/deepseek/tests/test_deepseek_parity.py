"""DeepSeek-V2 through the whole engine matches transformers (fp32, tiny random models).

Two shapes: V2-Lite-like (no q_lora_rank, grouped routing) and V2-like (q_lora_rank, YaRN with
DeepSeek's mscale, greedy routing). Both have a dense first layer, then MoE layers with shared
experts. Logits of mixed-length prompts at every position with chunked prefill over the paged
latent ("mla") cache, 32 greedy tokens, the same after a prefix-cache hit and after preemption;
and the cache takes ``kv_lora_rank + qk_rope_head_dim`` numbers per token and layer.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from framework import LLM, SamplingParams, hookimpl
from framework.errors import ConfigError
from framework.specs import AttentionBackendSpec
from framework.testing import (
    PARITY_PROMPTS,
    ModelParityTests,
    check_kernels_used,
    count_kernel_calls,
    reference_greedy,
    tiny_model_fixture,
)

SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    initializer_range=0.1,
)
LATENT = SMALL["kv_lora_rank"] + SMALL["qk_rope_head_dim"]

CONFIGS = {
    "v2_lite_grouped_routing": lambda: transformers.DeepseekV2Config(
        **SMALL,
        q_lora_rank=None,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    ),
    "v2_q_lora_yarn": lambda: transformers.DeepseekV2Config(
        **SMALL,
        q_lora_rank=24,
        topk_method="greedy",
        routed_scaling_factor=1.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.8,
            "mscale_all_dim": 0.6,
        },
    ),
}

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


tiny = tiny_model_fixture(CONFIGS)


class TestParity(ModelParityTests):
    """Logits and greedy ids against transformers: batched chunked prefill, a prefix-cache hit, preemption."""


def test_mla_cache_holds_the_latent_only(tiny):
    """Per token and layer the cache holds kv_lora_rank + qk_rope_head_dim numbers (the point of MLA),
    and a --mem budget buys blocks at that price."""
    path, _ = tiny
    llm = LLM(str(path), mem_mb=1)
    engine, layers = llm.engine, SMALL["num_hidden_layers"]
    caches = engine.core.runner.kv_caches
    num_blocks, block_size = engine.summary["kv_blocks"], 16
    assert [tuple(c.data.shape) for c in caches] == [(num_blocks + 1, block_size, LATENT)] * layers
    assert {c.kv_dtype for c in caches} == {"auto"}
    bytes_per_token = engine.summary["kv_bytes"] / engine.summary["kv_tokens"]
    assert bytes_per_token == layers * LATENT * 4  # fp32
    assert num_blocks == (1 << 20) // (block_size * layers * LATENT * 4)
    # expanded per-head keys and values would be 4 * (16 + 8 + 16) = 160 numbers per token and layer, not 40


class StandardOnlyBackend:
    """A plugin whose fast backend reads only the standard layout (as FlashInfer's does)."""

    @hookimpl
    def register_attention_backends(self):
        return [
            AttentionBackendSpec(
                name="standard_only",
                impl="fw_torch_attention.backend:TorchAttentionBackend",
                priority=100,
                kv_cache_layouts=("standard",),
            )
        ]


def test_backend_without_mla_layout_is_skipped_with_a_reason(tiny, register_fw_plugin, caplog):
    path, _ = tiny
    register_fw_plugin(StandardOnlyBackend(), "standard_only")
    with caplog.at_level("INFO", logger="fw.engine"):
        llm = LLM(str(path), num_blocks=8)
    assert llm.engine.attention_backend == "torch"
    assert "standard_only not used: KV layout 'mla' unsupported (it reads: standard)" in caplog.text
    with pytest.raises(ConfigError, match="'standard_only' cannot run: KV layout 'mla' unsupported"):
        LLM(str(path), num_blocks=8, attention_backend="standard_only")


def test_plugins_check_shows_which_backends_read_the_mla_layout():
    from typer.testing import CliRunner

    from cli.main import build_app

    result = CliRunner().invoke(build_app(), ["plugins", "check"])
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines() if line.startswith("  ")}
    assert lines["DeepseekV2ForCausalLM"].endswith("ok (KV layout: mla)")
    assert lines["torch"].endswith("(KV layouts: standard, mla)")
    assert lines["triton"].endswith("(KV layouts: standard, mla)")


def test_routing_group_limit_and_renormalisation():
    from fw_deepseek.moe import deepseek_v2_routing

    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0, 4.0, 4.5, 0.0, 0.0]])  # groups of 2: best per group 5, 1, 4.5, 0
    weights, ids = deepseek_v2_routing(
        logits, 2, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0
    )
    assert sorted(ids[0].tolist()) == [1, 5]  # expert 4 (score 4.0) is in group 2 too, but 5 beats it
    probs = logits.softmax(-1)[0]
    assert torch.allclose(weights[0].sort().values, (2.0 * probs[[5, 1]]).sort().values)
    weights, ids = deepseek_v2_routing(logits, 3, topk_method="greedy", norm_topk_prob=True, routed_scaling_factor=2.0)
    assert sorted(ids[0].tolist()) == [1, 4, 5] and torch.allclose(weights.sum(), torch.tensor(2.0))
    with pytest.raises(ValueError, match="valid: greedy, group_limited_greedy"):
        deepseek_v2_routing(logits, 2, topk_method="noaux_tc")


@pytest.mark.gpu
def test_greedy_tokens_match_transformers_on_cuda(tiny):
    """On the GPU: the Triton backend over the MLA cache (decode steps in CUDA graphs) and the
    fused_moe kernel of the registry, fp32, against transformers on the CPU; attention, fused_moe,
    the norms, rotary and SwiGLU (dense layer, shared experts) all ran in Triton (a fallback to
    torch fails)."""
    path, reference = tiny
    with count_kernel_calls() as calls:
        llm = LLM(str(path), device="cuda", dtype="float32", num_blocks=64, prefill_chunk_size=8)
        assert llm.engine.attention_backend == "triton"
        results = llm.generate([{"prompt_token_ids": p} for p in PARITY_PROMPTS], GREEDY)
    for prompt, result in zip(PARITY_PROMPTS, results, strict=True):
        assert result.outputs[0].token_ids == reference_greedy(reference, prompt)
    check_kernels_used(
        calls,
        {
            **dict.fromkeys(
                ["fused_moe", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"], "triton"
            ),
            "attention": "triton",
        },
    )


def test_quantized_kv_b_proj_that_cannot_dequantize_is_refused_at_start_up():
    """MLA absorbs kv_b_proj's weight: a quantization method that claims the layer must dequantize
    it (block-FP8 does, see fw_fp8's DeepSeek-V3 test); one that cannot is refused when the model
    is built, naming the layer and the method."""
    from fw_deepseek.model import DeepseekV2Attention

    from framework.config import ModelConfig
    from framework.layers import LinearMethod, UnquantizedLinearMethod

    class OtherMethod(LinearMethod):  # any method other than the plain weight, without dequantize()
        create_weights = UnquantizedLinearMethod.create_weights
        apply = UnquantizedLinearMethod.apply

    class Dequantizing(OtherMethod):
        def dequantize(self, layer):
            return layer.weight * 2

    class KvBOnly:
        def __init__(self, method):
            self.method = method

        def get_quant_method(self, layer, prefix):
            return self.method() if prefix.endswith("kv_b_proj") else None

    hf_config = CONFIGS["v2_lite_grouped_routing"]().to_dict()
    config = ModelConfig.from_hf_config({**hf_config, "architectures": ["DeepseekV2ForCausalLM"]}, dtype=torch.float32)
    assert not DeepseekV2Attention(config, 0, None, "model.layers.0.self_attn").kv_b_is_quantized
    attention = DeepseekV2Attention(config, 0, KvBOnly(Dequantizing), "model.layers.0.self_attn")
    torch.nn.init.normal_(attention.kv_b_proj.weight)
    attention.init_buffers("cpu")
    assert torch.equal(attention.kv_b_weight().flatten(0, 1), 2 * attention.kv_b_proj.weight)
    with pytest.raises(
        ConfigError, match=r"model\.layers\.0\.self_attn\.kv_b_proj: .*must dequantize; OtherMethod cannot"
    ):
        DeepseekV2Attention(config, 0, KvBOnly(OtherMethod), "model.layers.0.self_attn")
