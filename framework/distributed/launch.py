"""Start, watch and reap the local tensor-parallel worker processes.

Each worker is ``python -m <module>`` with its own payload on stdin (the engine's worker,
:mod:`framework.engine.tp_worker`, reads its engine options and rank there). A worker dies with its parent (Linux
``PR_SET_PDEATHSIG``), and leaves the group with an error when rank 0's connection closes, so
no process outlives the engine.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

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
    def spawn(cls, module: str, payloads: dict[int, bytes], *argv: str) -> WorkerGroup:
        """Start ``python -m module --rank=R *argv`` per rank ``R`` of ``payloads``, its payload on stdin."""
        processes = {}
        for rank, payload in payloads.items():
            process = subprocess.Popen(
                [sys.executable, "-m", module, f"--rank={rank}", *argv],
                stdin=subprocess.PIPE,
                # the worker compares its parent with this pid once it has asked to die with it
                env={**os.environ, "PYTHONUNBUFFERED": "1", "FW_WORKER_PARENT_PID": str(os.getpid())},
            )
            process.stdin.write(payload)
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
