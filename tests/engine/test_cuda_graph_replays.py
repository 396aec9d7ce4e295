"""Which steps the decode CUDA graphs replay (the choice is made on the host; no GPU needed)."""

from __future__ import annotations

import torch
from fw_torch_attention.backend import TorchAttentionBackend
from torch import nn

from framework.attention_backend import AttentionMetadata
from framework.engine.cuda_graphs import CUDAGraphRunner


def _metadata(num_reqs: int, num_tokens: int) -> AttentionMetadata:
    q_lens = torch.full((num_reqs,), num_tokens // num_reqs, dtype=torch.int32)
    cu_seqlens_q = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0, dtype=torch.int32)])
    seq_lens = q_lens + 5
    return AttentionMetadata(
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        block_table=torch.zeros(num_reqs, 1, dtype=torch.int32),
        slot_mapping=torch.arange(num_tokens),
        max_query_len=num_tokens // num_reqs,
        max_seq_len=int(seq_lens.max()),
        cu_seqlens_q_cpu=cu_seqlens_q,
        seq_lens_cpu=seq_lens,
        is_decode_only=num_tokens == num_reqs,
    )


def test_decode_steps_with_m_rope_positions_of_prompt_tokens_run_eagerly():
    """A decode-only step whose tokens are prompt tokens of prompts with images (each request's
    last chunk one token long) has M-RoPE positions [3, T]: the graphs were captured on [T]."""
    runner = CUDAGraphRunner(
        nn.Identity(),
        TorchAttentionBackend(),
        [],
        max_num_seqs=8,
        max_model_len=64,
        block_size=16,
        sink_block=0,
        device=torch.device("cpu"),
    )
    assert runner.buckets == [1, 2, 4, 8]
    assert runner.replays(torch.arange(3), _metadata(3, 3)) == 4
    assert runner.replays(torch.arange(8), _metadata(8, 8)) == 8
    assert runner.replays(torch.arange(6).view(3, 2), _metadata(2, 2)) is None  # M-RoPE
    assert runner.replays(torch.arange(4), _metadata(2, 4)) is None  # two tokens a request
    assert runner.replays(torch.arange(9), _metadata(9, 9)) is None  # beyond the largest bucket
