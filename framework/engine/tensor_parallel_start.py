"""Joining a tensor-parallel group: the layout and device from the engine's options
(:func:`place_rank`), the workers rank 0 starts, the group's rendezvous and the all-reduce set up
for it, and leaving the group after a failed build (:func:`leave_after_failure`).

With more than one rank, every rank runs, before it loads its shard: :func:`prepare_group`, then (rank 0 only) spawns :func:`workers_to_spawn` as
:mod:`~framework.engine.tp_worker` processes given :func:`worker_args`, then :func:`init_group`.
The caller holds the workers from the moment they start, so a failed rendezvous can still reap them.
"""

from __future__ import annotations

import os

import torch

from framework import distributed
from framework.config import ModelConfig
from framework.distributed.all_reduce_policy import AllReducePolicy
from framework.distributed.config import DEFAULT_MASTER_PORT, ParallelConfig, free_port
from framework.distributed.launch import WorkerGroup
from framework.engine.args import EngineArgs
from framework.engine.oom_hints import out_of_memory_names_the_flag
from framework.errors import ConfigError, FwError, ModelLoadError
from framework.layers.layernorm import RMSNorm


def parallel_config(args: EngineArgs, tp_rank: int | None = None) -> ParallelConfig:
    """The parallel layout ``args`` asks for; ``tp_rank`` places a worker (``None``: this node's first rank)."""
    return ParallelConfig(
        args.tensor_parallel_size,
        args.num_nodes,
        args.node_rank,
        args.device_ids,
        args.master_addr,
        args.master_port,
        args.rendezvous_timeout,
        args.distributed_timeout,
        tp_rank,
    )


def place_rank(args: EngineArgs, tp_rank: int | None = None) -> tuple[ParallelConfig, torch.device]:
    """This rank's layout and device (``--device``, or its GPU of ``--d`` / ``--tp``). A rank of a group
    makes its GPU current here, before anything touches CUDA, so no context lands on another rank's GPU."""
    parallel = parallel_config(args, tp_rank)
    device = parallel.device(args.device)
    if parallel.is_parallel and device.type == "cuda":
        torch.cuda.set_device(device)
    return parallel, device


def refuse_a_second_group() -> None:
    """Raise :class:`ConfigError` when this process already belongs to a tensor-parallel group."""
    if distributed.is_tensor_parallel():
        raise ConfigError(
            "this process already runs a tensor-parallel engine; close it (LLM.close() or "
            "Engine.shutdown()) before building another"
        )


def prepare_group(parallel: ParallelConfig, device: torch.device, architecture: str, can_shard: bool) -> None:
    """Ready this process for a group of more than one rank, before any worker starts: refuse an
    architecture that cannot be sharded (``can_shard`` false), settle ``parallel.master_port`` when
    unset, share the CPU threads among the node's ranks and bind to this rank's NUMA node. Refuses
    a process that already belongs to a group (:func:`refuse_a_second_group`)."""
    refuse_a_second_group()
    if not can_shard:
        raise ConfigError(
            f"architecture {architecture} cannot be sharded for tensor parallelism yet "
            f"(its plugin sets supports_tensor_parallel=False); run it on one device (--tp 1)"
        )
    if parallel.master_port is None:
        if parallel.num_nodes > 1:
            parallel.master_port = DEFAULT_MASTER_PORT
        else:
            parallel.master_port = free_port(parallel.master_addr)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, torch.get_num_threads() // parallel.ranks_per_node))
    from framework.distributed.numa import bind_to_numa_node

    bind_to_numa_node(parallel.local_rank)


def workers_to_spawn(parallel: ParallelConfig) -> list[int]:
    """The ranks this process starts as workers: the node's other ranks on rank 0, else none."""
    return list(range(1, parallel.ranks_per_node)) if parallel.rank == 0 and parallel.ranks_per_node > 1 else []


def init_group(
    parallel: ParallelConfig,
    device: torch.device,
    workers: WorkerGroup | None,
    all_reduce_policy: AllReducePolicy,
    config: ModelConfig,
    max_num_seqs: int,
) -> None:
    """Rendezvous with the other ranks (failing early when one of ``workers`` died) and set the
    all-reduce up for ``config``'s hidden size and ``max_num_seqs`` rows."""
    distributed.init_tensor_parallel(
        parallel.rank,
        parallel.tensor_parallel_size,
        device,
        master_addr=parallel.master_addr,
        master_port=parallel.master_port,
        rendezvous_timeout_s=parallel.rendezvous_timeout,
        timeout_s=parallel.distributed_timeout,
        check_workers=workers.failure if workers is not None else None,
    )
    with out_of_memory_names_the_flag("setting the all-reduce up"):
        all_reduce_policy.set_up(config.dtype, config.hidden_size, max_num_seqs)


def leave_after_failure(workers: WorkerGroup | None, error: BaseException) -> ModelLoadError | None:
    """After a failed build: reap ``workers`` and leave the group (no-op on one rank). Returns the
    error to raise instead of ``error`` when a worker died first and ``error`` is not fw's own (it
    is then a symptom, such as a broken rendezvous; the worker printed its own error), else ``None``."""
    reason = workers.wait_for_failure(1.0) if workers is not None else None
    if workers is not None:
        workers.close()
    distributed.destroy_tensor_parallel()
    if reason is not None and not isinstance(error, FwError):
        return ModelLoadError(f"{reason} while the model was loading (its error is printed above)")
    return None


def worker_args(args: EngineArgs, parallel: ParallelConfig, device: torch.device) -> EngineArgs:
    """The engine's options as another rank of the group gets them (the settled port and size)."""
    return args.replace(
        device=None if parallel.device_ids is not None else device.type,
        device_ids=parallel.device_ids,
        tensor_parallel_size=parallel.tensor_parallel_size,
        master_port=parallel.master_port,
    )


def enable_fused_norm(policy: AllReducePolicy, model: torch.nn.Module, config: ModelConfig, max_num_seqs: int) -> None:
    """Let ``policy`` fuse the all-reduce into the RMS norms of ``model`` that sum their input (once
    the sharded model is loaded; the policy decides whether the fused kernel fits)."""
    policy.enable_fused_norm(
        norms_take_all_reduce(model), config.architecture, max_num_seqs, config.hidden_size, config.dtype
    )


def norms_take_all_reduce(model: torch.nn.Module) -> bool:
    """Whether some RMS norm of ``model`` sums its input over the ranks (what the fused kernel replaces)."""
    return any(isinstance(module, RMSNorm) and module.reduces_input for module in model.modules())
