"""``ModelRunner.prepare_inputs``: one step's requests as flat tensors and attention metadata."""

from __future__ import annotations

import torch

from framework.distributed.messages import StepInput
from framework.engine.model_runner import ModelRunner


def test_a_mixed_step_pads_the_block_table_to_its_longest_row():
    """A prefill chunk with one block beside a decode with three (block size 4): the table is
    ``[2, 3]``, the short row padded with 0, on the device and the host alike."""
    runner = ModelRunner(model=None, backend=None, kv_caches=[], block_size=4, device=torch.device("cpu"), sampler=None)
    inputs = [StepInput([5, 6, 7], 0, [3], "prefill"), StepInput([9], 9, [1, 4, 2], "decode")]
    input_ids, positions, metadata = runner.prepare_inputs(inputs)
    assert input_ids.tolist() == [5, 6, 7, 9] and positions.tolist() == [0, 1, 2, 9]
    assert metadata.block_table.tolist() == metadata.block_table_cpu.tolist() == [[3, 0, 0], [1, 4, 2]]
    # position p is in block block_ids[p // 4] at offset p % 4: 9 -> block 2 (id 2), offset 1
    assert metadata.slot_mapping.tolist() == [12, 13, 14, 2 * 4 + 1]
    assert metadata.cu_seqlens_q.tolist() == metadata.cu_seqlens_q_cpu.tolist() == [0, 3, 4]
    assert metadata.seq_lens.tolist() == metadata.seq_lens_cpu.tolist() == [3, 10]
    assert (metadata.num_reqs, metadata.num_tokens, metadata.max_query_len, metadata.max_seq_len) == (2, 4, 3, 10)
    assert not metadata.is_decode_only


def test_a_decode_step_of_equal_rows_keeps_every_block():
    runner = ModelRunner(model=None, backend=None, kv_caches=[], block_size=4, device=torch.device("cpu"), sampler=None)
    inputs = [StepInput([8], 5, [6, 7], "a"), StepInput([11], 4, [0, 5], "b")]
    input_ids, positions, metadata = runner.prepare_inputs(inputs)
    assert input_ids.tolist() == [8, 11] and positions.tolist() == [5, 4]
    assert metadata.block_table.tolist() == [[6, 7], [0, 5]]
    assert metadata.slot_mapping.tolist() == [7 * 4 + 1, 5 * 4 + 0]
    assert metadata.seq_lens.tolist() == [6, 5] and metadata.is_decode_only
