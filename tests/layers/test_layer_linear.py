"""Linear layers: weight loaders place checkpoint tensors right, outputs equal F.linear on the full
weight, tensor-parallel shards reassemble the full weight, and meta construction materialises."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from framework.layers.linear import (
    ColumnParallelLinear,
    LinearMethod,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
    set_weight_attrs,
)
from framework.quantization import QuantConfig

HIDDEN, HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS = 32, 8, 4, 2


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def load(layer: nn.Module, name: str, tensor: torch.Tensor, shard_id=None) -> None:
    param = getattr(layer, name)
    if shard_id is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard_id)


def qkv_checkpoint():
    sizes = {"q": NUM_HEADS * HEAD_SIZE, "k": NUM_KV_HEADS * HEAD_SIZE, "v": NUM_KV_HEADS * HEAD_SIZE}
    return {s: (torch.randn(n, HIDDEN), torch.randn(n)) for s, n in sizes.items()}


def test_qkv_loader_places_q_k_v_shards_and_biases():
    ckpt = qkv_checkpoint()
    layer = QKVParallelLinear(HIDDEN, HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS, bias=True)
    for shard_id in ("v", "q", "k"):  # order of arrival must not matter
        load(layer, "weight", ckpt[shard_id][0], shard_id)
        load(layer, "bias", ckpt[shard_id][1], shard_id)
    full_w = torch.cat([ckpt[s][0] for s in "qkv"])
    full_b = torch.cat([ckpt[s][1] for s in "qkv"])
    assert torch.equal(layer.weight, full_w) and torch.equal(layer.bias, full_b)
    x = torch.randn(5, HIDDEN)
    torch.testing.assert_close(layer(x), F.linear(x, full_w, full_b), rtol=0, atol=0)


def test_qkv_loader_splits_an_already_fused_checkpoint_tensor():
    ckpt = qkv_checkpoint()
    fused_w = torch.cat([ckpt[s][0] for s in "qkv"])
    layer = QKVParallelLinear(HIDDEN, HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS)
    load(layer, "weight", fused_w)
    assert torch.equal(layer.weight, fused_w)
    with pytest.raises(ValueError, match="valid: 'q', 'k', 'v'"):
        load(layer, "weight", ckpt["q"][0], "x")


def test_merged_gate_up_loader_and_output():
    gate, up = torch.randn(48, HIDDEN), torch.randn(48, HIDDEN)
    layer = MergedColumnParallelLinear(HIDDEN, [48, 48])
    load(layer, "weight", up, 1)
    load(layer, "weight", gate, 0)
    x = torch.randn(3, 7, HIDDEN)
    torch.testing.assert_close(layer(x), F.linear(x, torch.cat([gate, up])), rtol=0, atol=0)


@pytest.mark.parametrize("cls", [ReplicatedLinear, ColumnParallelLinear, RowParallelLinear])
def test_plain_layers_equal_f_linear(cls):
    weight, bias = torch.randn(24, HIDDEN), torch.randn(24)
    layer = cls(HIDDEN, 24, bias=True)
    load(layer, "weight", weight)
    load(layer, "bias", bias)
    x = torch.randn(4, HIDDEN)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=0, atol=0)


def test_params_dtype_and_inference_only_parameters():
    layer = ColumnParallelLinear(HIDDEN, 16, bias=True, params_dtype=torch.bfloat16)
    assert layer.weight.dtype == layer.bias.dtype == torch.bfloat16
    assert not layer.weight.requires_grad


def test_checkpoint_of_wrong_shape_is_refused_with_both_shapes():
    layer = ColumnParallelLinear(HIDDEN, 16)
    with pytest.raises(ValueError, match=r"\(16, 31\).*\(16, 32\)"):
        load(layer, "weight", torch.randn(16, HIDDEN - 1))


def test_column_parallel_shards_concatenate_to_the_full_weight():
    weight, bias, x = torch.randn(24, HIDDEN), torch.randn(24), torch.randn(5, HIDDEN)
    ranks = [ColumnParallelLinear(HIDDEN, 24, bias=True, tp_size=2, tp_rank=r) for r in range(2)]
    for layer in ranks:
        load(layer, "weight", weight)
        load(layer, "bias", bias)
    assert ranks[0].weight.shape == (12, HIDDEN)
    assert torch.equal(torch.cat([layer.weight for layer in ranks]), weight)
    torch.testing.assert_close(torch.cat([layer(x) for layer in ranks], -1), F.linear(x, weight, bias))


def test_row_parallel_partial_outputs_sum_to_the_full_output_with_bias_once():
    weight, bias, x = torch.randn(24, HIDDEN), torch.randn(24), torch.randn(5, HIDDEN)
    ranks = [RowParallelLinear(HIDDEN, 24, bias=True, tp_size=2, tp_rank=r, reduce_results=False) for r in range(2)]
    for layer in ranks:
        load(layer, "weight", weight)
        load(layer, "bias", bias)
    assert torch.equal(torch.cat([layer.weight for layer in ranks], dim=1), weight)
    partials = [layer(x_part) for layer, x_part in zip(ranks, x.chunk(2, dim=-1), strict=True)]
    torch.testing.assert_close(partials[0] + partials[1], F.linear(x, weight, bias))


def test_merged_shards_hold_each_ranks_slice_of_every_output():
    gate, up = torch.randn(48, HIDDEN), torch.randn(48, HIDDEN)
    for rank in range(2):
        layer = MergedColumnParallelLinear(HIDDEN, [48, 48], tp_size=2, tp_rank=rank)
        load(layer, "weight", torch.cat([gate, up]))  # a fused checkpoint splits the same way
        assert torch.equal(layer.weight, torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_qkv_shards_split_heads_and_replicate_kv_heads_when_fewer_than_ranks(tp_size):
    ckpt = qkv_checkpoint()
    for rank in range(tp_size):
        layer = QKVParallelLinear(HIDDEN, HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS, bias=True, tp_size=tp_size, tp_rank=rank)
        for shard_id in "qkv":
            load(layer, "weight", ckpt[shard_id][0], shard_id)
            load(layer, "bias", ckpt[shard_id][1], shard_id)
        kv_head = rank * NUM_KV_HEADS // tp_size  # tp 4: ranks 0,1 share kv head 0
        kv_rows = slice(kv_head * layer.num_kv_heads * HEAD_SIZE, (kv_head + 1) * layer.num_kv_heads * HEAD_SIZE)
        q_rows = slice(rank * layer.num_heads * HEAD_SIZE, (rank + 1) * layer.num_heads * HEAD_SIZE)
        expected = torch.cat([ckpt["q"][0][q_rows], ckpt["k"][0][kv_rows], ckpt["v"][0][kv_rows]])
        assert torch.equal(layer.weight, expected)
        assert torch.equal(layer.bias, torch.cat([ckpt["q"][1][q_rows], ckpt["k"][1][kv_rows], ckpt["v"][1][kv_rows]]))


def test_uneven_tensor_parallel_split_is_refused():
    with pytest.raises(ValueError, match="output size 25 is not divisible by the tensor-parallel size 2"):
        ColumnParallelLinear(HIDDEN, 25, tp_size=2)


def test_meta_construction_to_empty_keeps_loaders_and_loads():
    gate, up = torch.randn(48, HIDDEN), torch.randn(48, HIDDEN)
    with torch.device("meta"):
        layer = MergedColumnParallelLinear(HIDDEN, [48, 48], bias=True)
    assert layer.weight.device.type == "meta"
    layer.to_empty(device="cpu")
    assert layer.weight.output_dim == 0 and layer.weight.input_dim == 1
    load(layer, "weight", gate, 0)
    load(layer, "weight", up, 1)
    load(layer, "bias", torch.ones(48) * 0.5, 0)
    load(layer, "bias", torch.ones(48) * -0.5, 1)
    x = torch.randn(2, HIDDEN)
    torch.testing.assert_close(
        layer(x), F.linear(x, torch.cat([gate, up]), torch.cat([torch.full((48,), 0.5), torch.full((48,), -0.5)]))
    )


class PairPackedMethod(LinearMethod):
    """A toy 'quantized' format: two output rows packed per parameter row ([out/2, 2*in])."""

    def create_weights(
        self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype
    ):
        packed = nn.Parameter(
            torch.empty(sum(output_partition_sizes) // 2, 2 * input_size_per_partition), requires_grad=False
        )
        set_weight_attrs(packed, {"output_dim": 0, "input_dim": None, "weight_loader": layer.weight_loader})
        layer.register_parameter("packed", packed)

    def process_weights_after_loading(self, layer):
        layer.unpacked = layer.packed.reshape(-1, layer.input_size_per_partition)

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.unpacked, bias)


class PairPackedConfig(QuantConfig):
    @classmethod
    def get_name(cls):
        return "pair-packed"

    def get_quant_method(self, layer, prefix):
        return None if prefix.endswith("o_proj") else PairPackedMethod()

    @classmethod
    def from_config(cls, config):
        return cls()


def test_quant_config_method_reuses_the_layer_loaders_on_packed_rows():
    config = PairPackedConfig.from_config({})
    ckpt = qkv_checkpoint()
    for rank in range(2):
        layer = QKVParallelLinear(
            HIDDEN,
            HEAD_SIZE,
            NUM_HEADS,
            NUM_KV_HEADS,
            quant_config=config,
            prefix="layers.0.qkv_proj",
            tp_size=2,
            tp_rank=rank,
        )
        assert isinstance(layer.linear_method, PairPackedMethod) and not hasattr(layer, "weight")
        for shard_id in "qkv":
            load(layer, "packed", ckpt[shard_id][0].reshape(-1, 2 * HIDDEN), shard_id)
        layer.linear_method.process_weights_after_loading(layer)
        reference = QKVParallelLinear(HIDDEN, HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS, tp_size=2, tp_rank=rank)
        for shard_id in "qkv":
            load(reference, "weight", ckpt[shard_id][0], shard_id)
        x = torch.randn(3, HIDDEN)
        torch.testing.assert_close(layer(x), reference(x), rtol=0, atol=0)
    o_proj = RowParallelLinear(HIDDEN, HIDDEN, quant_config=config, prefix="layers.0.o_proj")
    assert isinstance(o_proj.linear_method, UnquantizedLinearMethod)
