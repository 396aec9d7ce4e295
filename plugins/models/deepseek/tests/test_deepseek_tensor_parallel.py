"""DeepSeek-V2 under tensor parallelism on CPU (gloo): the dense MLPs, the routed experts and the
shared experts are split along their intermediate features, and so are the heads of multi-head
latent attention (every rank caches the whole latent). The MoE block sums its two partial outputs
and all-reduces them once."""

from __future__ import annotations

import pytest
import torch
import transformers
from fw_deepseek.model import DeepseekV2ForCausalLM
from fw_deepseek.moe import DeepseekV2MoE

from framework import LLM, SamplingParams, distributed
from framework.config import ModelConfig
from framework.distributed import state
from framework.loader.model_loader import load_weights
from framework.testing import reference_greedy, write_randomised_model

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
    n_shared_experts=2,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    initializer_range=0.1,
)
CONFIGS = {  # test_deepseek_parity's two shapes (two shared experts here)
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
PROMPTS = [[5, 9, 33, 2, 71], list(range(40, 59))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("case", "tp"), [(case, 2) for case in sorted(CONFIGS)] + [("v2_q_lora_yarn", 4)])
def test_tensor_parallel_greedy_ids_match_transformers(case, tp, tmp_path):
    reference = write_randomised_model(tmp_path, CONFIGS[case]())
    with LLM(
        str(tmp_path),
        device="cpu",
        num_blocks=16,
        prefill_chunk_size=8,
        max_num_batched_tokens=16,
        tensor_parallel_size=tp,
    ) as llm:
        assert llm.engine.summary["tensor_parallel_size"] == tp
        attention = llm.engine.core.runner.model.model.layers[0].self_attn
        assert attention.num_heads == SMALL["num_attention_heads"] // tp  # rank 0 computes its share of the heads
        assert attention.kv_b_weight().shape[0] == attention.num_heads
        ids = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    assert ids == [reference_greedy(reference, prompt, GREEDY.max_tokens) for prompt in PROMPTS]


class OneMoE(torch.nn.Module):
    """A DeepSeek MoE block under the checkpoint names of a layer's ``mlp``, loaded as the model loads it."""

    packed_modules_mapping = DeepseekV2ForCausalLM.packed_modules_mapping
    map_weight_name = staticmethod(DeepseekV2ForCausalLM.map_weight_name)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.mlp = DeepseekV2MoE(config, None, "mlp")


def test_moe_block_sums_its_ranks_partial_outputs_with_one_all_reduce(monkeypatch):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    hf_config = CONFIGS["v2_lite_grouped_routing"]()
    torch.manual_seed(0)
    reference = DeepseekV2Moe(hf_config).eval()
    for param in reference.parameters():
        torch.nn.init.normal_(param, std=0.1)
    hidden = torch.randn(7, SMALL["hidden_size"])
    with torch.no_grad():
        expected = reference(hidden.unsqueeze(0))[0]
    config = ModelConfig.from_hf_config(
        {**hf_config.to_dict(), "architectures": ["DeepseekV2ForCausalLM"]}, dtype=torch.float32
    )
    reductions = []
    monkeypatch.setattr(distributed, "all_reduce", lambda x: reductions.append(x.shape) or x)  # the sum is taken below
    partials = []
    for rank in range(2):
        monkeypatch.setattr(state._state, "size", 2)
        monkeypatch.setattr(state._state, "rank", rank)
        block = OneMoE(config)
        load_weights(block, [(f"mlp.{name}", tensor) for name, tensor in reference.state_dict().items()])
        reductions.clear()
        partials.append(block.mlp(hidden))
        assert reductions == [hidden.shape]  # the routed and the shared experts' sum, reduced once
    torch.testing.assert_close(partials[0] + partials[1], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_on_two_gpus_gives_the_greedy_ids_of_transformers(tmp_path):
    """NCCL, the registry's fused_moe kernel on each rank's expert slices, fp32."""
    reference = write_randomised_model(tmp_path, CONFIGS["v2_lite_grouped_routing"]())
    with LLM(str(tmp_path), device_ids=[0, 1], dtype="float32", num_blocks=64, prefill_chunk_size=8) as llm:
        assert llm.engine.summary["tensor_parallel_size"] == 2
        ids = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    assert ids == [reference_greedy(reference, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
