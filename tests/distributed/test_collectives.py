"""The tensor-parallel collectives on two gloo ranks (CPU): what each rank gets back."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from framework import distributed
from framework.distributed.config import free_port


def _rank(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    distributed.init_tensor_parallel(rank, 2, torch.device("cpu"), master_port=port, rendezvous_timeout_s=60)
    try:
        mine = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank  # rank r's vocabulary shard
        results[f"gather/{rank}"] = distributed.gather_to_rank0(mine, dim=-1)
    finally:
        distributed.destroy_tensor_parallel()


def test_gather_to_rank0_concatenates_on_rank0_and_leaves_the_others_their_part():
    shards = [torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank for rank in range(2)]
    full = torch.cat(shards, dim=-1)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(free_port(), results), nprocs=2, join=True)
        results = dict(results)
    torch.testing.assert_close(results["gather/0"], full)
    torch.testing.assert_close(results["gather/1"], shards[1])  # sent to rank 0, not gathered here
