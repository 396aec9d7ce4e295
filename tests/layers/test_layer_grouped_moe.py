"""DeepSeek-V3's grouped top-k router and MoE block against transformers' DeepseekV3 modules."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter

from framework.config import ModelConfig
from framework.layers.fused_moe import map_expert_weight_name
from framework.layers.grouped_moe import GroupedTopkMoE, GroupedTopkRouter, grouped_topk
from framework.loader.model_loader import load_parameters


def _config(**overrides) -> transformers.DeepseekV3Config:
    settings = dict(
        hidden_size=32,
        moe_intermediate_size=16,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    return transformers.DeepseekV3Config(**{**settings, **overrides})


def _randomised(module: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.normal_(std=0.5)
    return module.eval()


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_matches_transformers_choosing_with_the_bias_and_weighting_without(norm_topk_prob):
    hf_config = _config(norm_topk_prob=norm_topk_prob)
    reference = _randomised(DeepseekV3TopkRouter(hf_config))
    hidden = torch.randn(64, 32)
    _, expected_weights, expected_ids = reference(hidden)
    router = GroupedTopkRouter(32, 16, 4, num_groups=4, topk_groups=2, renormalize=norm_topk_prob, scaling_factor=2.5)
    router.load_state_dict(reference.state_dict())
    weights, ids = router(hidden)
    order, expected_order = ids.long().sort(-1), expected_ids.sort(-1)
    assert torch.equal(order.values, expected_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), expected_weights.gather(1, expected_order.indices))
    groups = ids.long() // 4
    assert all(len(set(row.tolist())) <= 2 for row in groups)  # only topk_group=2 groups are used


def test_bias_chooses_but_does_not_weight():
    logits = torch.zeros(1, 4)  # every sigmoid score is 0.5
    bias = torch.tensor([0.0, 1.0, -1.0, 2.0])
    weights, ids = grouped_topk(logits, 2, correction_bias=bias, renormalize=False, scaling_factor=3.0)
    assert sorted(ids[0].tolist()) == [1, 3]
    torch.testing.assert_close(weights, torch.full((1, 2), 1.5))


def test_group_score_is_the_sum_of_the_two_best():
    # group 0 has the single best expert, group 1 the best pair: the pair's group wins with topk_group=1
    logits = torch.logit(torch.tensor([[0.9, 0.1, 0.8, 0.7]]))
    _, ids = grouped_topk(logits, 2, num_groups=2, topk_groups=1)
    assert sorted(ids[0].tolist()) == [2, 3]


def test_moe_block_matches_transformers_with_shared_experts():
    hf_config = _config()
    reference = _randomised(DeepseekV3MoE(hf_config))
    hidden = torch.randn(9, 32)
    with torch.no_grad():
        expected = reference(hidden.unsqueeze(0))[0]
    config = ModelConfig.from_hf_config(
        {**hf_config.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}, dtype=torch.float32
    )

    class Holder(torch.nn.Module):
        packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        map_weight_name = staticmethod(map_expert_weight_name)

        def __init__(self):
            super().__init__()
            self.mlp = GroupedTopkMoE(config, None, "mlp")

    holder = Holder()
    state = reference.state_dict()
    gate_up, down = state.pop("experts.gate_up_proj"), state.pop("experts.down_proj")
    weights = [(f"mlp.{name}", tensor) for name, tensor in state.items()]
    weights += [("mlp.experts.gate_up_proj", gate_up), ("mlp.experts.down_proj", down)]
    assert len(load_parameters(holder, weights)) == len(list(holder.parameters()))
    torch.testing.assert_close(holder.mlp(hidden), expected, rtol=1e-5, atol=1e-5)


def test_bad_router_settings_name_what_is_valid():
    with pytest.raises(ValueError, match="n_group must divide the 16 experts"):
        GroupedTopkRouter(32, 16, 4, num_groups=3, topk_groups=1)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=8 must be in 1\.\.4"):
        GroupedTopkRouter(32, 16, 8, num_groups=4, topk_groups=1)
    config = ModelConfig.from_hf_config(
        {**_config().to_dict(), "architectures": ["DeepseekV3ForCausalLM"], "scoring_func": "softmax"},
        dtype=torch.float32,
    )
    with pytest.raises(ValueError, match="scoring_func 'softmax' is unsupported; valid: sigmoid"):
        GroupedTopkMoE(config, None, "mlp")
