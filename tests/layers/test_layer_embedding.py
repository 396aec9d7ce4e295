"""VocabEmbedding and LMHead: lookups and logits against F.embedding / F.linear, vocab-parallel
shards, and weight tying that survives meta construction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import framework.layers.embedding as embedding_module
from framework.layers.embedding import LMHead, VocabEmbedding

VOCAB, HIDDEN = 64, 16


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def load(param: torch.Tensor, tensor: torch.Tensor) -> None:
    param.weight_loader(param, tensor)


def test_embedding_looks_up_rows_of_the_loaded_table():
    table, ids = torch.randn(VOCAB, HIDDEN), torch.randint(0, VOCAB, (3, 5))
    embedding = VocabEmbedding(VOCAB, HIDDEN)
    load(embedding.weight, table)
    torch.testing.assert_close(embedding(ids), F.embedding(ids, table), rtol=0, atol=0)


def test_lm_head_logits_equal_f_linear_with_bias():
    table, bias, hidden = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB), torch.randn(4, HIDDEN)
    head = LMHead(VOCAB, HIDDEN, bias=True)
    load(head.weight, table)
    load(head.bias, bias)
    torch.testing.assert_close(head(hidden), F.linear(hidden, table, bias), rtol=0, atol=0)


def test_vocab_parallel_ranks_hold_consecutive_vocab_slices(monkeypatch):
    table, ids = torch.randn(VOCAB, HIDDEN), torch.randint(0, VOCAB, (11,))
    ranks = [VocabEmbedding(VOCAB, HIDDEN, tp_size=2, tp_rank=r) for r in range(2)]
    for embedding in ranks:
        load(embedding.weight, table)
    assert torch.equal(torch.cat([e.weight for e in ranks]), table)
    monkeypatch.setattr(embedding_module, "tensor_parallel_all_reduce", lambda x: x)  # sum below instead
    partials = [embedding(ids) for embedding in ranks]
    assert (partials[0][ids >= VOCAB // 2] == 0).all()
    torch.testing.assert_close(partials[0] + partials[1], F.embedding(ids, table), rtol=0, atol=0)


@pytest.mark.parametrize("lazy", [False, True], ids=["tensor", "checkpoint_slice"])
def test_vocab_padded_to_the_ranks_gets_zero_rows_past_the_checkpoint(lazy):
    """10 tokens over 4 ranks: padded to 12, 3 rows a rank; rank 3 holds token 9 and two zero rows
    (the rows and the bias, read lazily under tensor parallelism)."""
    from framework.loader.checkpoint_slice import CheckpointSlice

    table, bias = torch.randn(10, HIDDEN), torch.randn(10)
    wrap = (lambda t: CheckpointSlice(t, tuple(t.shape))) if lazy else (lambda t: t)
    heads = [LMHead(10, HIDDEN, bias=True, tp_size=4, tp_rank=r) for r in range(4)]
    for head in heads:
        head.weight.fill_(float("nan"))
        head.bias.fill_(float("nan"))
        load(head.weight, wrap(table))
        load(head.bias, wrap(bias))
    rows, biases = torch.cat([h.weight for h in heads]), torch.cat([h.bias for h in heads])
    assert torch.equal(rows[:10], table) and torch.equal(rows[10:], torch.zeros(2, HIDDEN))
    assert torch.equal(biases[:10], bias) and torch.equal(biases[10:], torch.zeros(2))


def test_vocab_parallel_lm_head_shards_concatenate_to_the_full_logits_in_rank_order(monkeypatch):
    table, hidden = torch.randn(VOCAB, HIDDEN), torch.randn(3, HIDDEN)
    heads = [LMHead(VOCAB, HIDDEN, tp_size=2, tp_rank=r) for r in range(2)]
    for head in heads:
        load(head.weight, table)
    monkeypatch.setattr(embedding_module, "tensor_parallel_gather_to_rank0", lambda x, dim: x)
    torch.testing.assert_close(torch.cat([head(hidden) for head in heads], -1), F.linear(hidden, table))


class TinyTiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(VOCAB, HIDDEN)
        self.lm_head = LMHead(VOCAB, HIDDEN).tie_weights(self.embed_tokens)


def test_tied_lm_head_shares_the_embedding_parameter():
    model = TinyTiedModel()
    assert model.lm_head.weight is model.embed_tokens.weight
    assert [name for name, _ in model.named_parameters()] == ["embed_tokens.weight"]
    assert list(model.state_dict()) == ["embed_tokens.weight"]
    assert model.lm_head.linear_method is None  # the embedding's method post-processes the table once


def test_tie_survives_meta_construction_and_to_empty():
    table, hidden, ids = torch.randn(VOCAB, HIDDEN), torch.randn(2, HIDDEN), torch.randint(0, VOCAB, (4,))
    with torch.device("meta"):
        model = TinyTiedModel()
    model.to_empty(device="cpu")
    load(model.embed_tokens.weight, table)
    assert model.lm_head.weight is model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head(hidden), F.linear(hidden, table), rtol=0, atol=0)
    torch.testing.assert_close(model.embed_tokens(ids), F.embedding(ids, table), rtol=0, atol=0)


def test_tying_mismatched_shapes_is_refused():
    with pytest.raises(ValueError, match="cannot tie LM head 64x16"):
        LMHead(VOCAB, HIDDEN).tie_weights(VocabEmbedding(VOCAB, HIDDEN * 2))
