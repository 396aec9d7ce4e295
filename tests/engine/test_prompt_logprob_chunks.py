"""Prompt logprobs (``echo`` + ``logprobs``) are computed in row pieces, so a long prompt never holds
full-vocabulary logits for all its rows at once, and the pieces give the unchunked result."""

from __future__ import annotations

import pytest
import torch
import transformers

from framework import LLM, SamplingParams
from framework.testing import write_tiny_model

TINY = transformers.LlamaConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    initializer_range=0.1,
    eos_token_id=1,
    bos_token_id=0,
)
PROMPT = [(7 * i + 3) % 94 + 2 for i in range(150)]
SCORED = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1, prompt_logprobs=3)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    write_tiny_model(path, TINY)
    return str(path)


def scored(tiny_path, max_rows: int, prefill_chunk_size: int) -> tuple[list, list[int]]:
    """The prompt logprobs of PROMPT and the row count of every ``compute_logits`` call."""
    llm = LLM(
        tiny_path, num_blocks=64, prefill_chunk_size=prefill_chunk_size, max_num_batched_tokens=prefill_chunk_size
    )
    runner = llm.engine.core.runner
    runner.max_prompt_logprob_rows = max_rows
    model, compute_logits, rows = runner.model, runner.model.compute_logits, []

    def counting(hidden):
        rows.append(hidden.shape[0])
        return compute_logits(hidden)

    model.compute_logits = counting
    result = llm.generate({"prompt_token_ids": PROMPT}, SCORED)[0]
    return result.prompt_logprobs, rows


def reference_logprobs(tiny_path) -> torch.Tensor:
    """log_softmax of transformers' logits over PROMPT: row p scores token p + 1."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("prefill_chunk_size", [64, 512])
def test_prompt_logprobs_in_row_pieces_equal_the_unchunked_ones(tiny_path, prefill_chunk_size):
    whole, whole_rows = scored(tiny_path, max_rows=4096, prefill_chunk_size=prefill_chunk_size)
    pieces, piece_rows = scored(tiny_path, max_rows=7, prefill_chunk_size=prefill_chunk_size)
    assert max(whole_rows) == min(prefill_chunk_size, len(PROMPT)) - (prefill_chunk_size > len(PROMPT))
    assert max(piece_rows) == 7  # no call saw more than a piece of the prompt
    assert len(pieces) == len(whole) == len(PROMPT) and pieces[0] is whole[0] is None
    for (lp, top), (lp_whole, top_whole) in zip(pieces[1:], whole[1:]):
        assert lp == pytest.approx(lp_whole, abs=1e-5)
        assert [t for t, _ in top] == [t for t, _ in top_whole]
        assert [v for _, v in top] == pytest.approx([v for _, v in top_whole], abs=1e-5)
    reference = reference_logprobs(tiny_path)
    for position in range(1, len(PROMPT)):
        assert pieces[position][0] == pytest.approx(float(reference[position - 1, PROMPT[position]]), abs=1e-4)
        assert [t for t, _ in pieces[position][1]] == reference[position - 1].topk(3).indices.tolist()
