"""What rank 0 hands a tensor-parallel worker: its :class:`WorkerSpec` on stdin of
``python -m framework.engine.tp_worker`` (kept apart from the worker, which imports the builder
that spawns it)."""

from __future__ import annotations

import msgspec

from framework.distributed.launch import WorkerGroup
from framework.engine.args import EngineArgs

#: the worker's module (``python -m``): how :class:`~framework.distributed.launch.WorkerGroup` starts a worker.
WORKER_MODULE = "framework.engine.tp_worker"


class WorkerSpec(msgspec.Struct, kw_only=True):
    """What a worker reads on stdin: the engine's options (placed for its node) and its global rank."""

    args: EngineArgs
    tp_rank: int


def spawn_workers(args: EngineArgs, ranks: list[int]) -> WorkerGroup:
    """Start one worker process per rank in ``ranks``, each building ``args``'s engine as that rank."""
    return WorkerGroup.spawn(
        WORKER_MODULE,
        {rank: msgspec.json.encode(WorkerSpec(args=args, tp_rank=rank)) for rank in ranks},
        f"--master={args.master_addr}:{args.master_port}",
    )
