"""A tensor-parallel worker process: build this rank's shard, then run the steps rank 0 broadcasts.

``python -m framework.engine.tp_worker --rank=R`` with a :class:`WorkerSpec` (the engine's
:class:`EngineArgs` and the rank) as JSON on stdin. Started by rank 0 for the other ranks of its node, and by
``fw serve --node-rank N`` (N > 0) for every rank of node N. It never schedules or samples:
each :class:`~framework.distributed.messages.StepMessage` is one forward pass (joining the
model's all-reduces) and the ``compute_logits`` calls rank 0 makes (sending their vocabulary
shards to rank 0).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

import msgspec

from framework.engine.args import EngineArgs
from framework.engine.worker_spec import WorkerSpec, spawn_workers


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (no orphaned workers); exit at once
    if the parent that spawned it (``FW_WORKER_PARENT_PID``) is already gone, since one that died
    before the request was made (an engine killed while its worker starts) never sends the signal."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: rank 0's closed connection still stops the worker
        return
    parent = os.environ.get("FW_WORKER_PARENT_PID")
    if parent and os.getppid() != int(parent):
        os._exit(1)


def serve_steps(runner) -> None:
    """Run broadcast steps until rank 0 sends ``shutdown`` (or its connection breaks: an exception)."""
    from framework.distributed.messages import StepMessage
    from framework.distributed.state import broadcast_message

    while True:
        message = broadcast_message(None, StepMessage)
        if message.shutdown:
            return
        runner.execute_message(message)


def main(argv: list[str]) -> int:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; rank 0 decides
    logging.basicConfig(level=os.environ.get("FW_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    return run_worker(msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerSpec))


def run_worker(spec: WorkerSpec) -> int:
    """Build rank ``spec.tp_rank`` and serve steps until rank 0 ends the group; the exit code."""
    rank = spec.tp_rank
    from framework.distributed.state import destroy_tensor_parallel
    from framework.engine.builder import EngineBuilder
    from framework.errors import FwError, brief

    try:
        try:
            runner = EngineBuilder(args=spec.args, tp_rank=rank).build_worker()
        except FwError as error:
            print(f"fw: error: tensor-parallel rank {rank}: {error}", file=sys.stderr, flush=True)
            return 1
        except Exception:
            traceback.print_exc()
            return 1
        try:
            serve_steps(runner)
            runner.release_cuda_graphs()  # before leaving the group: the graphs hold its collectives
        except Exception as error:  # rank 0 went away or a collective failed
            print(f"fw: tensor-parallel rank {rank} stopped: {brief(error)}", file=sys.stderr, flush=True)
            return 1
        return 0
    finally:
        destroy_tensor_parallel()


def run_node(args: EngineArgs) -> int:
    """``fw serve --node-rank N`` for N > 0: run this node's ranks as workers until rank 0 stops them.

    Returns the exit code (0 when rank 0 shut the group down cleanly).
    """
    from framework.distributed.config import DEFAULT_MASTER_PORT
    from framework.engine.tensor_parallel_start import parallel_config

    parallel = parallel_config(args)
    args = args.replace(
        master_port=parallel.master_port or DEFAULT_MASTER_PORT, tensor_parallel_size=parallel.tensor_parallel_size
    )
    ranks = list(range(parallel.first_local_rank, parallel.first_local_rank + parallel.ranks_per_node))
    print(
        f"fw: node {parallel.node_rank} of {parallel.num_nodes}: running tensor-parallel rank(s) "
        f"{', '.join(map(str, ranks))}, joining {args.master_addr}:{args.master_port}",
        flush=True,
    )
    group = spawn_workers(args, ranks[1:])  # the node's first rank runs in this process
    # The rank waits for steps inside gloo, where Python signal handlers never run: let Ctrl-C and
    # SIGTERM end the process at once (the spawned ranks follow through PR_SET_PDEATHSIG).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        code = run_worker(WorkerSpec(args=args, tp_rank=ranks[0]))
        return code or group.wait()
    finally:
        group.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
