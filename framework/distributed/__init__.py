"""Tensor parallelism: the process group state, its collectives, and the worker processes.

Layers read :func:`get_tp_rank` / :func:`get_tp_size` when they are built, so a model made of
``framework.layers`` shards itself once :func:`init_tensor_parallel` has run (the engine does
that for ``--tp`` / ``--d 0,1``). See docs/tensor-parallel.md.
"""

from framework.distributed.all_reduce_policy import enable_flashinfer_all_reduce_norm, enable_symm_mem_all_reduce
from framework.distributed.state import (
    all_reduce,
    all_reduce_add_rms_norm,
    broadcast_message,
    destroy_tensor_parallel,
    gather_to_rank0,
    get_tp_rank,
    get_tp_size,
    init_tensor_parallel,
    is_tensor_parallel,
    min_over_ranks,
)

__all__ = [
    "all_reduce",
    "all_reduce_add_rms_norm",
    "broadcast_message",
    "destroy_tensor_parallel",
    "enable_flashinfer_all_reduce_norm",
    "enable_symm_mem_all_reduce",
    "gather_to_rank0",
    "get_tp_rank",
    "get_tp_size",
    "init_tensor_parallel",
    "is_tensor_parallel",
    "min_over_ranks",
]
