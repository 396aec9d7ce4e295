"""Start, watch and reap the local tensor-parallel worker processes.

Each worker is ``python -m framework.distributed.worker`` with the engine's builder keyword
arguments (its own ``tp_rank``) as JSON on stdin. A worker dies with its parent (Linux
``PR_SET_PDEATHSIG``), and leaves the group with an error when rank 0's connection closes, so
no process outlives the engine.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("fw.distributed")


def describe_exit(code: int) -> str:
    """``-9`` -> ``"was killed by SIGKILL"``; ``1`` -> ``"exited with code 1"``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class WorkerGroup:
    """The worker processes this process started, by global rank."""

    def __init__(self, processes: dict[int, subprocess.Popen]) -> None:
        self.processes = processes
        self.closed = False
        self.stopping = False  # set before asking the workers to exit: their exits are no failure
        atexit.register(self.close)

    @classmethod
    def spawn(cls, builder_kwargs: dict[str, Any], ranks: list[int]) -> WorkerGroup:
        """Start one worker per rank in ``ranks``, each building the model as that rank."""
        processes = {}
        for rank in ranks:
            process = subprocess.Popen(
                [sys.executable, "-m", "framework.distributed.worker", f"--rank={rank}",
                 f"--master={builder_kwargs.get('master_addr')}:{builder_kwargs.get('master_port')}"],
                stdin=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            process.stdin.write(json.dumps({**builder_kwargs, "tp_rank": rank}).encode())
            process.stdin.close()
            processes[rank] = process
        return cls(processes)

    @property
    def pids(self) -> dict[int, int]:
        return {rank: process.pid for rank, process in self.processes.items()}

    def failure(self) -> str | None:
        """Why the group is broken (a worker exited), or None while every worker runs."""
        if self.closed or self.stopping:
            return None
        for rank, process in self.processes.items():
            code = process.poll()
            if code is not None:
                return f"tensor-parallel worker rank {rank} (pid {process.pid}) {describe_exit(code)}"
        return None

    def wait_for_failure(self, timeout_s: float) -> str | None:
        """:meth:`failure`, waiting up to ``timeout_s`` for a dying worker to be reaped."""
        deadline = time.monotonic() + timeout_s
        while (reason := self.failure()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return reason

    def start_watchdog(self, on_failure: Callable[[str], None], poll_s: float = 0.5) -> None:
        """Call ``on_failure(reason)`` from a daemon thread once a worker exits unexpectedly."""

        def watch() -> None:
            while not self.closed:
                reason = self.failure()
                if reason is not None:
                    on_failure(reason)
                    return
                time.sleep(poll_s)

        threading.Thread(target=watch, name="fw-tp-watchdog", daemon=True).start()

    def wait(self) -> int:
        """Block until every worker exits; a failing worker stops the others. Returns the worst exit code."""
        worst = 0
        try:
            while any(p.poll() is None for p in self.processes.values()):
                if self.failure() is not None and any(p.returncode not in (None, 0) for p in self.processes.values()):
                    break
                time.sleep(0.2)
        finally:
            self.close()
        for process in self.processes.values():
            worst = worst or (process.returncode or 0)
        return worst

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop and reap every worker (terminate, then kill after ``timeout_s``); idempotent."""
        if self.closed:
            return
        self.closed = self.stopping = True
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def run_node(builder_kwargs: dict[str, Any]) -> int:
    """``fw serve --node-rank N`` for N > 0: run this node's ranks as workers until rank 0 stops them.

    Returns the exit code (0 when rank 0 shut the group down cleanly).
    """
    from framework.distributed.config import DEFAULT_MASTER_PORT, ParallelConfig

    parallel = ParallelConfig(builder_kwargs.get("tensor_parallel_size"), builder_kwargs.get("num_nodes", 1),
                              builder_kwargs.get("node_rank", 0), builder_kwargs.get("device_ids"),
                              builder_kwargs.get("master_addr", "127.0.0.1"), builder_kwargs.get("master_port"))
    kwargs = {**builder_kwargs, "master_port": parallel.master_port or DEFAULT_MASTER_PORT,
              "tensor_parallel_size": parallel.tensor_parallel_size}
    if "dtype" in kwargs and not isinstance(kwargs["dtype"], str):
        kwargs["dtype"] = str(kwargs["dtype"]).removeprefix("torch.")
    ranks = list(range(parallel.first_local_rank, parallel.first_local_rank + parallel.ranks_per_node))
    print(f"fw: node {parallel.node_rank} of {parallel.num_nodes}: running tensor-parallel rank(s) "
          f"{', '.join(map(str, ranks))}, joining {kwargs['master_addr'] if 'master_addr' in kwargs else '127.0.0.1'}:"
          f"{kwargs['master_port']}", flush=True)
    from framework.distributed.worker import run_worker

    group = WorkerGroup.spawn(kwargs, ranks[1:])  # the node's first rank runs in this process
    # The rank waits for steps inside gloo, where Python signal handlers never run: let Ctrl-C and
    # SIGTERM end the process at once (the spawned ranks follow through PR_SET_PDEATHSIG).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        code = run_worker({**kwargs, "tp_rank": ranks[0]})
        return code or group.wait()
    finally:
        group.close()
