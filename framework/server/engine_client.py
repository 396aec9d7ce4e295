"""``AsyncEngineClient``: the API process's handle on the engine process.

It starts ``python -m framework.engine.engine_process``, sends msgspec-encoded requests over a ZMQ
PUSH socket, and one background task routes the batched step outputs to per-request queues.

Supervision: a watcher thread notices when the engine process exits. Every waiting ``generate``
then raises :class:`EngineDeadError` instead of hanging, ``is_healthy`` turns False, and (unless
``restart`` is off) a new engine process is started on fresh sockets; once it reports ready the
client serves again and ``num_restarts`` counts it. A restart that fails to load is retried a few
times with a growing delay, then the engine stays dead. An engine whose loop sends nothing
(outputs or heartbeats) for ``heartbeat_timeout_s`` is ``is_unresponsive``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import tokenizers
import zmq
import zmq.asyncio

from framework.engine.messages import (
    AbortRequests,
    AddFailed,
    AddRequest,
    EngineFailed,
    EngineReply,
    GetStats,
    Heartbeat,
    LoadFailed,
    Ready,
    Shutdown,
    StatsReply,
    StepOutputs,
)
from framework.engine.outputs import GRAMMAR_FAILED, OUT_OF_MEMORY, EngineStats, RequestOutput
from framework.errors import ConfigError, FwError, GrammarError, RequestFailedError
from framework.multimodal.inputs import ImageInput
from framework.sampling_params import SamplingParams
from framework.tokenizer import Tokenizer


class EngineDeadError(FwError):
    """The engine process exited or failed; requests in flight cannot finish."""


class EngineLoadError(FwError):
    """The engine process could not load the model; the message says why."""


#: Delays before the attempts to restart a dead engine (a failed load moves on to the next one).
RESTART_DELAYS_S = (0.0, 1.0, 4.0)


class AsyncEngineClient:
    """Start, talk to, supervise and stop one engine process. Methods must be called on one event loop."""

    def __init__(
        self,
        builder_kwargs: dict[str, Any],
        *,
        restart: bool = True,
        heartbeat_timeout_s: float = 60.0,
        chat_template: str | None = None,
    ) -> None:
        self.builder_kwargs = builder_kwargs
        #: ``--chat-template``: replaces the model's own template
        self.chat_template = chat_template
        self.restart = restart
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.ready: Ready | None = None
        self.tokenizer: Tokenizer | None = None
        self.dead_reason: str | None = None
        self.process: subprocess.Popen | None = None
        self.num_restarts = 0
        self.is_restarting = False
        self.last_heard = time.monotonic()  # when the engine process last sent anything
        self._closing = False
        self._restarter: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._ready_future: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineReply)

    # --- life cycle ----------------------------------------------------------------------
    async def start(self) -> Ready:
        """Spawn the engine process and wait until it reports ready; raises EngineLoadError."""
        self.ready = await self._spawn()
        spec = self.ready.tokenizer
        self.tokenizer = Tokenizer(
            tokenizers.Tokenizer.from_str(spec.tokenizer_json),
            self.chat_template if self.chat_template is not None else spec.chat_template,
            spec.bos_token,
            spec.eos_token,
            spec.pad_token,
            frozenset(spec.extra_eos_token_ids),
            spec.template_vars,
        )
        return self.ready

    async def _spawn(self) -> Ready:
        """Open fresh sockets, start an engine process on them, and wait for its Ready."""
        loop = asyncio.get_running_loop()
        self._tmpdir = tempfile.TemporaryDirectory(prefix="fw-ipc-")
        input_addr = f"ipc://{self._tmpdir.name}/input"
        output_addr = f"ipc://{self._tmpdir.name}/output"
        self._sync_context = zmq.Context()
        self._input = self._sync_context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_addr)
        self._context = zmq.asyncio.Context()
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_addr)
        self._ready_future = loop.create_future()
        self._reader = asyncio.create_task(self._read_outputs(self._output, self._decoder))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "framework.engine.engine_process", input_addr, output_addr],
            stdin=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.process.stdin.write(json.dumps(self.builder_kwargs).encode())
        self.process.stdin.close()
        process = self.process
        threading.Thread(
            target=lambda: (process.wait(), loop.call_soon_threadsafe(self._on_exit, process)),
            name="fw-engine-watcher",
            daemon=True,
        ).start()
        ready = await self._ready_future
        self.last_heard = time.monotonic()
        return ready

    def _close_sockets(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if hasattr(self, "_input"):
            self._input.close()
            self._output.close()
            self._context.term()
            self._sync_context.term()
            self._tmpdir.cleanup()
            del self._input

    async def _restart(self) -> None:
        """Start a new engine process in place of the dead one (see the module docstring)."""
        self.is_restarting = True
        try:
            for attempt, delay in enumerate(RESTART_DELAYS_S, 1):
                await asyncio.sleep(delay)
                if self._closing:
                    return
                self._close_sockets()
                try:
                    ready = await self._spawn()
                except Exception as error:  # noqa: BLE001 - a failed load (EngineLoadError) or a socket error
                    self.dead_reason = (
                        f"the engine could not be restarted (attempt {attempt} of {len(RESTART_DELAYS_S)}): {error}"
                    )
                    continue
                self.ready, self.dead_reason = ready, None
                self.num_restarts += 1
                return
        finally:
            self.is_restarting = False

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the engine process to exit, kill it if it does not, and close the sockets."""
        self._closing = True
        if self._restarter is not None:
            self._restarter.cancel()
        process = self.process
        if process is not None and process.poll() is None:
            try:
                self._send(Shutdown())
            except zmq.Again:  # the engine has not connected yet
                process.terminate()
            try:
                await asyncio.wait_for(asyncio.to_thread(process.wait), timeout_s)
            except asyncio.TimeoutError:
                process.kill()
                await asyncio.to_thread(process.wait)
        self._fail_all("the server is shutting down")
        self._close_sockets()

    @property
    def is_ready(self) -> bool:
        return self.ready is not None and self.dead_reason is None

    @property
    def is_healthy(self) -> bool:
        return self.is_ready and self.process is not None and self.process.poll() is None

    @property
    def is_unresponsive(self) -> bool:
        """The engine is up but its loop has sent nothing for ``heartbeat_timeout_s`` (wedged in a step)."""
        return self.is_healthy and time.monotonic() - self.last_heard > self.heartbeat_timeout_s

    # --- requests ------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        pooling: str | None = None,
        images: list[ImageInput] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield this request's outputs until one has a finish reason (with ``pooling``: one output
        carrying the embedding).

        Raises ConfigError if the engine refuses the request, at once or later (GrammarError: its
        grammar failed to compile), RequestFailedError if a step it was in failed, and
        EngineDeadError if the engine dies. Leaving early (break, cancellation, a client
        disconnect) aborts the request.
        """
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._queues:
            raise ConfigError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            self._send(
                AddRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt_token_ids,
                    params=params,
                    pooling=pooling,
                    images=images or [],
                )
            )
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    if item.error_kind == GRAMMAR_FAILED:
                        raise GrammarError(item.error)
                    raise RequestFailedError(item.error, out_of_memory=item.error_kind == OUT_OF_MEMORY)
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, *request_ids: str) -> None:
        """Stop requests in the engine (unknown or finished ids are ignored)."""
        for request_id in request_ids:
            self._queues.pop(request_id, None)
        if request_ids and self.dead_reason is None and self.process is not None:
            with contextlib.suppress(zmq.Again):  # no engine connected: nothing to abort
                self._send(AbortRequests(request_ids=list(request_ids)))

    async def stats(self, timeout_s: float = 10.0) -> EngineStats:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._stats_waiters[query_id] = future
        try:
            self._send(GetStats(query_id=query_id))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._stats_waiters.pop(query_id, None)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # --- internals -----------------------------------------------------------------------
    def _send(self, message) -> None:
        self._input.send(self._encoder.encode(message), flags=zmq.NOBLOCK)

    async def _read_outputs(self, socket: zmq.asyncio.Socket, decoder: msgspec.msgpack.Decoder) -> None:
        """Route one engine process's messages (its own socket: a restarted engine has new ones)."""
        while True:
            message = decoder.decode(await socket.recv())
            self.last_heard = time.monotonic()
            if isinstance(message, Heartbeat):
                continue
            if isinstance(message, StepOutputs):
                for output in message.outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
            elif isinstance(message, StatsReply):
                future = self._stats_waiters.get(message.query_id)
                if future is not None and not future.done():
                    future.set_result(message.stats)
            elif isinstance(message, AddFailed):
                queue = self._queues.get(message.request_id)
                if queue is not None:
                    error_type = (
                        GrammarError if message.grammar else RequestFailedError if message.internal else ConfigError
                    )
                    queue.put_nowait(error_type(message.message))
            elif isinstance(message, Ready):
                if not self._ready_future.done():
                    self._ready_future.set_result(message)
            elif isinstance(message, LoadFailed):
                if not self._ready_future.done():
                    self._ready_future.set_exception(EngineLoadError(message.message))
            elif isinstance(message, EngineFailed):
                self._mark_dead(message.message)

    def _on_exit(self, process: subprocess.Popen) -> None:
        if process is not self.process:
            return
        future = self._ready_future
        if future is not None and not future.done():
            future.set_exception(
                EngineLoadError(f"the engine process exited with code {process.returncode} before the model was loaded")
            )
        was_serving = future is not None and not future.cancelled() and future.exception() is None
        restarting = was_serving and self.restart and not self._closing
        reason = self.dead_reason or f"the engine process exited (code {process.returncode})"
        if restarting:
            reason += "; it is being restarted, retry the request shortly"
            self.is_restarting = True  # from now on, not once the restart task first runs (/health says so)
        self._mark_dead(reason)
        if restarting:  # (a process that never got ready is retried, or reported, by whoever spawned it)
            self._restarter = asyncio.ensure_future(self._restart())

    def _mark_dead(self, reason: str) -> None:
        self.dead_reason = reason
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        for queue in list(self._queues.values()):
            queue.put_nowait(EngineDeadError(reason))
        for future in self._stats_waiters.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
