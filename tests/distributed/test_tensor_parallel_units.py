"""Tensor-parallel building blocks without processes: head split, vocab padding, flags, NUMA lists."""

from __future__ import annotations

import os

import pytest
import torch

from framework.distributed.config import ParallelConfig
from framework.distributed.numa import bind_to_numa_node, parse_cpulist
from framework.distributed.partition import AttentionHeads, attention_heads_per_rank
from framework.errors import ConfigError
from framework.layers import LMHead, QKVParallelLinear, VocabEmbedding


def test_attention_heads_split_or_replicate_kv_heads():
    assert attention_heads_per_rank(32, 8, 2) == AttentionHeads(16, 4, 1)
    assert attention_heads_per_rank(8, 2, 4) == AttentionHeads(2, 1, 2)
    assert attention_heads_per_rank(4, 1, 2) == AttentionHeads(2, 1, 2)
    with pytest.raises(ConfigError, match="6 attention heads cannot be split over 4"):
        attention_heads_per_rank(6, 2, 4)


def test_qkv_layer_reports_this_ranks_heads_and_loads_the_replicated_kv_head():
    full = {name: torch.randn(rows * 8, 16) for name, rows in (("q", 8), ("k", 2), ("v", 2))}
    for rank in range(4):
        layer = QKVParallelLinear(16, 8, 8, 2, tp_size=4, tp_rank=rank).to_empty(device="cpu")
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        for shard, weight in full.items():
            layer.weight_loader(layer.weight, weight, shard)
        q, k, v = layer.weight.split([16, 8, 8])
        kv_head = rank // 2  # ranks 0-1 share KV head 0, ranks 2-3 KV head 1
        assert torch.equal(q, full["q"][rank * 16 : (rank + 1) * 16])
        assert torch.equal(k, full["k"][kv_head * 8 : (kv_head + 1) * 8])
        assert torch.equal(v, full["v"][kv_head * 8 : (kv_head + 1) * 8])


def test_vocab_padded_to_a_multiple_of_the_ranks_with_zero_rows():
    table = torch.randn(10, 4)
    shards = []
    for rank in range(4):
        embedding = VocabEmbedding(10, 4, tp_size=4, tp_rank=rank).to_empty(device="cpu")
        assert embedding.num_embeddings_padded == 12 and embedding.weight.shape == (3, 4)
        embedding.weight_loader(embedding.weight, table)
        shards.append(embedding.weight)
    padded = torch.cat(shards)
    assert torch.equal(padded[:10], table) and not padded[10:].any()
    head = LMHead(10, 4, tp_size=4, tp_rank=3)
    assert head.num_embeddings_per_partition == 3


def test_parallel_config_places_ranks_and_refuses_bad_sizes():
    config = ParallelConfig(4, num_nodes=2, node_rank=1)
    assert (config.ranks_per_node, config.rank, config.local_rank) == (2, 2, 0)
    assert ParallelConfig(device_ids=[0, 1], num_nodes=2).tensor_parallel_size == 4
    assert ParallelConfig(2, device_ids=[3, 5], rank=1).device(None) == torch.device("cuda", 5)
    assert ParallelConfig(2).device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="power of two"):
        ParallelConfig(3)
    with pytest.raises(ConfigError, match="disagrees with --d"):
        ParallelConfig(2, device_ids=[0, 1, 2, 3])
    with pytest.raises(ConfigError, match="--node-rank must be in"):
        ParallelConfig(2, num_nodes=2, node_rank=2)
    with pytest.raises(ConfigError, match="cannot be spread evenly"):
        ParallelConfig(2, num_nodes=4)


def test_numa_binding_reads_the_nodes_cpulist(tmp_path):
    assert parse_cpulist("0-2,5,7-8\n") == {0, 1, 2, 5, 7, 8}
    allowed = sorted(os.sched_getaffinity(0))
    (tmp_path / "node1").mkdir()
    (tmp_path / "node1" / "cpulist").write_text(f"{allowed[0]}\n")
    try:
        assert bind_to_numa_node(1, "0,1", str(tmp_path)) == {allowed[0]}
        assert os.sched_getaffinity(0) == {allowed[0]}
    finally:
        os.sched_setaffinity(0, allowed)
    assert bind_to_numa_node(0, "", str(tmp_path)) is None
    with pytest.raises(ConfigError, match="NUMA node 7 does not exist"):
        bind_to_numa_node(0, "7", str(tmp_path))


def test_tensor_parallel_safetensors_loading_reads_only_each_ranks_slice(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from framework.distributed import state
    from framework.layers import RowParallelLinear
    from framework.loader.checkpoint_slice import CheckpointSlice
    from framework.loader.model_loader import load_weights
    from framework.loader.safetensors_format import SafetensorsFormat

    weight = torch.randn(6, 8)
    save_file({"proj.weight": weight}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(state._state, "size", 2)
    [(name, lazy)] = list(SafetensorsFormat(tmp_path).iter_weights())
    assert isinstance(lazy, CheckpointSlice) and lazy.shape == (6, 8)
    assert torch.equal(lazy.narrow(1, 4, 4).narrow(0, 1, 2).materialize(), weight[1:3, 4:8])

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = RowParallelLinear(8, 6, tp_size=2, tp_rank=1)

    model = Model().to_empty(device="cpu")
    assert load_weights(model, SafetensorsFormat(tmp_path).iter_weights()) == {"proj.weight"}
    assert torch.equal(model.proj.weight, weight[:, 4:])


def test_a_model_with_its_own_load_weights_gets_whole_tensors_under_tensor_parallelism(tmp_path, monkeypatch):
    """Lazy slices are for the core layers' loaders: a model's own ``load_weights`` gets whole
    tensors unless it declares ``reads_checkpoint_slices``."""
    from safetensors.torch import save_file

    from framework.distributed import state
    from framework.loader.checkpoint_slice import CheckpointSlice
    from framework.loader.model_loader import load_weights
    from framework.loader.safetensors_format import SafetensorsFormat

    weight = torch.randn(6, 8)
    save_file({"proj.weight": weight}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(state._state, "size", 2)

    class OwnLoader(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 6, bias=False)
            self.received = []

        def load_weights(self, weights):
            for _name, tensor in weights:
                self.received.append(tensor)
                self.proj.weight.data.copy_(tensor)  # a CheckpointSlice would fail here
            return {"proj.weight"}

    model = OwnLoader()
    assert load_weights(model, SafetensorsFormat(tmp_path).iter_weights()) == {"proj.weight"}
    assert type(model.received[0]) is torch.Tensor and torch.equal(model.proj.weight, weight)

    model = OwnLoader()
    model.reads_checkpoint_slices = True
    with pytest.raises(
        TypeError, match="must be Tensor, not CheckpointSlice"
    ):  # it said it would narrow and materialize the slices itself
        load_weights(model, SafetensorsFormat(tmp_path).iter_weights())
    assert isinstance(model.received[0], CheckpointSlice)


def test_step_messages_carry_only_new_block_ids_and_workers_rebuild_the_tables():
    import msgspec

    from framework.distributed.messages import BlockTableSync, StepInput, StepMessage

    sender, receiver = BlockTableSync(), BlockTableSync()
    tables = {"a": [4, 9], "b": [7]}
    steps = [
        ["a", "b"],  # first sight: whole tables
        ["a", "b"],  # decode, no new block: nothing
        ["a"],  # b waits (not scheduled): forgotten on both sides
        ["a", "b"],  # b again: sent whole
        ["a", "b"],  # a grew by one block; b preempted and given new blocks
        ["a", "b"],  # b preempted again, given the same ids in a new list: sent whole (safe)
    ]
    sent_sizes = []
    for number, ids in enumerate(steps):
        if number == 4:
            tables["a"].append(11)  # the request's own list grows in place
            tables["b"] = [2, 3]  # freed blocks: the KV cache manager gives the request a new list
        if number == 5:
            tables["b"] = [2, 3]
        inputs = [StepInput([5], 17, tables[r], r) for r in ids]
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(StepMessage(sender.compress(inputs))), type=StepMessage)
        received = receiver.expand(wire.inputs)
        assert [(i.request_id, i.block_ids) for i in received] == [(r, tables[r]) for r in ids]
        sent_sizes.append(sum(len(i.block_ids) for i in wire.inputs))
    assert sent_sizes == [3, 0, 0, 1, 3, 2]
