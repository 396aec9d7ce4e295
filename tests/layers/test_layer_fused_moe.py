"""FusedMoE: routing, the torch reference op, and the weight loader's checkpoint layouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framework import ops
from framework.layers.fused_moe import FusedMoE, expert_weight_target, map_expert_weight_name, select_experts


def _experts(num_experts=4, hidden=16, inter=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(2, num_experts, inter, hidden, generator=generator)
    down = torch.randn(num_experts, hidden, inter, generator=generator)
    return gate, up, down


def test_select_experts_is_softmax_top_k_and_optionally_renormalised():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 4.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[1, 2], [2, 3]] and ids.dtype == torch.int32
    torch.testing.assert_close(weights, probs.gather(1, ids.long()))
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


def test_reference_op_is_the_weighted_sum_of_each_tokens_experts():
    gate, up, down = _experts()
    hidden = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    topk_ids = torch.tensor([[0, 2], [3, 0], [1, 1]])
    topk_weights = torch.tensor([[0.7, 0.3], [0.5, 0.25], [0.6, 0.4]])
    w13 = torch.cat([gate, up], dim=1)
    out = ops.fused_moe(hidden, w13, down, topk_weights, topk_ids)
    for t in range(3):
        expected = sum(
            w * down[e] @ (F.silu(gate[e] @ hidden[t]) * (up[e] @ hidden[t]))
            for w, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist())
        )
        torch.testing.assert_close(out[t], expected, rtol=1e-5, atol=1e-5)


def _load(layer, name, tensor):
    param_name, (shard, expert) = expert_weight_target(name)
    param = dict(layer.named_parameters())[param_name.rpartition("experts.")[2]]
    param.weight_loader(param, tensor, shard, expert)


@pytest.mark.parametrize("layout", ["qwen_per_expert", "mixtral_per_expert", "transformers_stacked", "gguf_stacked"])
def test_every_checkpoint_layout_loads_the_same_stacked_weights(layout):
    gate, up, down = _experts()
    layer = FusedMoE(4, 2, 16, 8, renormalize=True, prefix="model.layers.0.mlp.experts")
    prefix = "model.layers.0.mlp.experts"
    if layout in ("qwen_per_expert", "mixtral_per_expert"):
        names = ("gate_proj", "up_proj", "down_proj") if layout == "qwen_per_expert" else ("w1", "w3", "w2")
        for e in range(4):
            for proj, tensor in zip(names, (gate[e], up[e], down[e])):
                _load(layer, f"{prefix}.{e}.{proj}.weight", tensor)
    elif layout == "transformers_stacked":
        _load(layer, f"{prefix}.gate_up_proj", torch.cat([gate, up], dim=1))
        _load(layer, f"{prefix}.down_proj", down)
    else:
        for proj, tensor in zip(("gate_proj", "up_proj", "down_proj"), (gate, up, down)):
            _load(layer, f"{prefix}.{proj}.weight", tensor)
    assert torch.equal(layer.w13_weight, torch.cat([gate, up], dim=1))
    assert torch.equal(layer.w2_weight, down)
    assert layer.missing_weights() == []


def test_layer_reports_the_expert_shards_not_loaded():
    gate, up, _ = _experts()
    layer = FusedMoE(4, 2, 16, 8, renormalize=True)
    layer.weight_loader(layer.w13_weight, gate, "w1")
    layer.weight_loader(layer.w13_weight, up[1], "w3", 1)
    assert layer.missing_weights() == [
        "up (w13_weight) of expert(s) 0, 2, 3",
        "down (w2_weight) of expert(s) 0, 1, 2, 3",
    ]


def test_loader_refuses_wrong_shapes_shards_and_experts():
    gate, _, down = _experts()
    layer = FusedMoE(4, 2, 16, 8, renormalize=True, prefix="moe")
    with pytest.raises(ValueError, match="does not fit"):
        layer.weight_loader(layer.w13_weight, gate[0].T, "w1", 0)
    with pytest.raises(ValueError, match="unknown expert shard 'w4'"):
        layer.weight_loader(layer.w13_weight, gate[0], "w4", 0)
    with pytest.raises(ValueError, match="expert 4 out of range"):
        layer.weight_loader(layer.w13_weight, gate[0], "w1", 4)
    with pytest.raises(ValueError, match="does not belong"):
        layer.weight_loader(layer.w13_weight, down[0], "w2", 0)
    with pytest.raises(ValueError, match="top_k"):
        FusedMoE(4, 5, 16, 8, renormalize=True)


def test_non_expert_names_are_left_alone():
    assert expert_weight_target("model.layers.0.mlp.shared_expert.gate_proj.weight") is None
    assert expert_weight_target("model.layers.0.mlp.gate.weight") is None


def test_map_expert_weight_name_routes_experts_and_passes_other_names_through():
    """The ``map_weight_name`` that MoE models (fw_llama's, fw_deepseek's) share."""
    assert map_expert_weight_name("model.layers.3.mlp.experts.5.up_proj.weight") == (
        "model.layers.3.mlp.experts.w13_weight",
        ("w3", 5),
    )
    assert map_expert_weight_name("model.layers.0.mlp.experts.down_proj.weight") == (
        "model.layers.0.mlp.experts.w2_weight",
        ("w2", None),
    )
    shared = "model.layers.0.mlp.shared_experts.gate_proj.weight"
    assert map_expert_weight_name(shared) == (shared, None)


def test_forward_takes_router_logits_or_a_precomputed_routing():
    gate, up, down = _experts()
    layer = FusedMoE(4, 2, 16, 8, renormalize=False)
    layer.w13_weight.copy_(torch.cat([gate, up], dim=1))
    layer.w2_weight.copy_(down)
    hidden = torch.randn(5, 16, generator=torch.Generator().manual_seed(2))
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    routed = select_experts(logits, 2, renormalize=False)
    torch.testing.assert_close(
        layer(hidden, logits), layer(hidden, topk_weights=routed.topk_weights, topk_ids=routed.topk_ids)
    )
    # a different routing (sigmoid scores, as DeepSeek-V3) gives a different answer through the same experts
    sigmoid_weights, sigmoid_ids = torch.sigmoid(logits).topk(2, dim=-1)
    assert not torch.allclose(layer(hidden, logits), layer(hidden, topk_weights=sigmoid_weights, topk_ids=sigmoid_ids))
    with pytest.raises(ValueError, match="router_logits"):
        layer(hidden)


def test_geglu_experts_apply_gelu_tanh_between_the_projections():
    """``activation="gelu_tanh"`` (Gemma 4): gelu_tanh(gate) * up per expert; biases or a clamp with it are refused."""
    gate, up, down = _experts()
    layer = FusedMoE(4, 2, 16, 8, renormalize=False, activation="gelu_tanh")
    layer.w13_weight.copy_(torch.cat([gate, up], dim=1))
    layer.w2_weight.copy_(down)
    assert not layer.is_plain_swiglu and layer.activation().gelu_tanh
    hidden = torch.randn(3, 16, generator=torch.Generator().manual_seed(4))
    topk_ids = torch.tensor([[0, 2], [3, 0], [1, 1]], dtype=torch.int32)
    topk_weights = torch.tensor([[0.7, 0.3], [0.5, 0.25], [0.6, 0.4]])
    out = layer(hidden, topk_weights=topk_weights, topk_ids=topk_ids)
    for t in range(3):
        expected = sum(
            w * down[e] @ (F.gelu(gate[e] @ hidden[t], approximate="tanh") * (up[e] @ hidden[t]))
            for w, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist())
        )
        torch.testing.assert_close(out[t], expected, rtol=1e-5, atol=1e-5)
    for bad in (dict(activation="relu"), dict(activation="gelu_tanh", bias=True)):
        with pytest.raises(ValueError, match="valid: 'silu'"):
            FusedMoE(4, 2, 16, 8, renormalize=False, **bad)
