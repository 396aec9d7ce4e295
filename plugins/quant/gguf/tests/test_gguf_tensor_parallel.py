"""GGUF under tensor parallelism: each rank keeps whole packed rows of column-parallel layers (KV heads
replicated when there are fewer than ranks) and of the padded vocabulary, and a block-aligned byte
range of every row of row-parallel layers; dequantized, the ranks' parts put back together are the
whole matrix. The engine test on the real Gemma 3 file runs on the GPU machine (two devices)."""

from __future__ import annotations

import pytest
import torch
from fw_gguf.dequant import dequantize
from fw_gguf.method import GGUFLinearMethod
from gguf import GGMLQuantizationType as Q

from framework.errors import ConfigError
from framework.layers import QKVParallelLinear, RowParallelLinear, VocabEmbedding


class OneMethod:
    """A QuantConfig stand-in that gives every layer a GGUF method with ``shards``."""

    def __init__(self, shards) -> None:
        self.shards = shards

    def get_quant_method(self, layer, prefix):
        return GGUFLinearMethod(self.shards)


def packed(random_packed, qtype: Q, rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_packed(qtype, rows, cols, seed=seed).copy())


def dense(tensor: torch.Tensor, qtype: Q, rows: int, cols: int) -> torch.Tensor:
    return dequantize(tensor, qtype, (rows, cols), torch.float32)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F16])
def test_qkv_ranks_hold_their_heads_and_the_replicated_kv_head(random_packed, qtype):
    head, hidden = 32, 256  # 4 query heads, 2 KV heads over 4 ranks: each KV head on 2 ranks
    full = {
        "q": packed(random_packed, qtype, 4 * head, hidden, 1),
        "k": packed(random_packed, qtype, 2 * head, hidden, 2),
        "v": packed(random_packed, qtype, 2 * head, hidden, 3),
    }
    whole = {name: dense(t, qtype, t.shape[0], hidden) for name, t in full.items()}
    for rank in range(4):
        layer = QKVParallelLinear(
            hidden, head, 4, 2, quant_config=OneMethod([(s, qtype.name) for s in "qkv"]), tp_size=4, tp_rank=rank
        )
        for shard, tensor in full.items():
            layer.weight.weight_loader(layer.weight, tensor, shard)
        q, k, v = layer.linear_method.dequantized(layer, torch.float32).split([head, head, head])
        kv = rank // 2
        assert torch.equal(q, whole["q"][rank * head : (rank + 1) * head])
        assert torch.equal(k, whole["k"][kv * head : (kv + 1) * head]) and torch.equal(
            v, whole["v"][kv * head : (kv + 1) * head]
        )


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_0, Q.Q8_0, Q.F32])
def test_row_parallel_ranks_hold_block_aligned_input_columns(random_packed, qtype):
    tensor = packed(random_packed, qtype, 8, 1024, 4)
    parts = []
    for rank in range(2):
        layer = RowParallelLinear(1024, 8, quant_config=OneMethod([(None, qtype.name)]), tp_size=2, tp_rank=rank)
        layer.weight.weight_loader(layer.weight, tensor)
        parts.append(layer.linear_method.dequantized(layer, torch.float32))
    assert torch.equal(torch.cat(parts, dim=1), dense(tensor, qtype, 8, 1024))


def test_vocabulary_rows_are_split_and_padded_with_zero_rows(random_packed):
    tensor = packed(random_packed, Q.Q8_0, 10, 64, 5)
    parts = []
    for rank in range(4):
        table = VocabEmbedding(10, 64, quant_config=OneMethod([(None, Q.Q8_0.name)]), tp_size=4, tp_rank=rank)
        table.weight.weight_loader(table.weight, tensor)
        parts.append(table.linear_method.dequantized(table, torch.float32))
    rows = torch.cat(parts)
    assert torch.equal(rows[:10], dense(tensor, Q.Q8_0, 10, 64)) and not rows[10:].any()


def test_row_parallel_width_that_splits_a_quant_block_is_refused():
    with pytest.raises(ConfigError, match="384 input features per rank is not a whole number of Q4_K blocks of 256"):
        RowParallelLinear(768, 8, quant_config=OneMethod([(None, Q.Q4_K.name)]), tp_size=2, tp_rank=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_gemma3_q4_k_m_tp2_gives_the_ids_of_one_device(gemma3_gguf_path):
    from framework import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = "Once upon a time, in a small village,"
    with LLM(str(gemma3_gguf_path), device="cuda:0", dtype="f32", num_blocks=64) as llm:
        expected = llm.generate(prompt, params)[0].outputs[0].token_ids
    with LLM(str(gemma3_gguf_path), device_ids=[0, 1], dtype="f32", num_blocks=64) as llm:
        assert llm.engine.summary["tensor_parallel_size"] == 2
        assert llm.generate(prompt, params)[0].outputs[0].token_ids == expected
