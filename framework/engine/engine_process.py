"""The engine process: load the model, then step while work exists, else block on the input socket.

Started by :class:`~framework.server.engine_client.AsyncEngineClient` as
``python -m framework.engine.engine_process <input addr> <output addr>`` with the engine's
:class:`~framework.engine.args.EngineArgs` as JSON on stdin. It never touches HTTP or text.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

from framework.engine.args import EngineArgs
from framework.engine.messages import (
    AbortRequests,
    AddFailed,
    AddRequest,
    EngineFailed,
    EngineRequest,
    GetStats,
    Heartbeat,
    LoadFailed,
    Ready,
    Shutdown,
    StatsReply,
    StepOutputs,
    TokenizerSpec,
)
from framework.sampling_params import sampling_defaults

log = logging.getLogger("fw.engine")

#: How often an idle engine wakes up to check that the API process still exists.
_IDLE_POLL_MS = 1000
#: A loop that has sent nothing for this long sends a Heartbeat (the API process's /health watches them).
HEARTBEAT_INTERVAL_S = 1.0
#: How long the loop has to report a dead tensor-parallel worker before the watchdog exits the process.
_WORKER_FAILURE_GRACE_S = 10.0


def _tokenizer_spec(tokenizer) -> TokenizerSpec:
    return TokenizerSpec(
        tokenizer_json=tokenizer.backend.to_str(),
        chat_template=tokenizer.chat_template,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        extra_eos_token_ids=sorted(tokenizer.extra_eos_token_ids),
        template_vars=dict(tokenizer.template_vars),
    )


def _leave_a_core_to_the_api_process(device: str | None) -> None:
    """On CPU, compute with one core less than torch would take (unless OMP_NUM_THREADS says otherwise).

    With every core busy in the engine's OpenMP pool, the API process (detokenizing, streaming)
    preempts a pool thread, and each parallel region then waits for it (on a machine of few cores,
    steps many times slower than with one thread fewer).
    """
    import torch

    if "OMP_NUM_THREADS" in os.environ or (device or ("cuda" if torch.cuda.is_available() else "cpu")) != "cpu":
        return
    torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) - 1)))


class EngineLoop:
    """Owns the sockets and the :class:`EngineCore`; ``run()`` returns when told to shut down."""

    def __init__(self, input_addr: str, output_addr: str) -> None:
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PULL)
        self.input.connect(input_addr)
        self.output = self.context.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDHWM, 0)
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(output_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineRequest)
        self.parent_pid = os.getppid()
        self.core = None
        self.engine = None
        self.last_sent = time.monotonic()

    def send(self, message) -> None:
        data = self.encoder.encode(message)
        self.last_sent = time.monotonic()
        while True:
            try:
                self.output.send(data, flags=zmq.NOBLOCK)
                return
            except zmq.Again:  # no API process connected (yet, or any more)
                if os.getppid() != self.parent_pid:
                    raise SystemExit(0) from None
                self.output.poll(100, zmq.POLLOUT)

    def load(self, args: EngineArgs | dict) -> bool:
        """Build the engine of ``args`` (or of the equivalent keyword options) and report Ready or LoadFailed."""
        from framework.engine.builder import EngineBuilder
        from framework.errors import FwError

        try:
            if isinstance(args, dict):
                args = EngineArgs.from_options(**args)
            _leave_a_core_to_the_api_process(args.device)
            engine = EngineBuilder(args=args).build()
        except FwError as error:
            self.send(LoadFailed(message=str(error)))
            return False
        except Exception as error:  # an unexpected failure still reaches the user, with its type
            traceback.print_exc()
            self.send(LoadFailed(message=f"{type(error).__name__}: {error}"))
            return False
        self.core, self.engine = engine.core, engine
        if engine.workers is not None:
            engine.workers.start_watchdog(self._on_worker_failure)
        config = engine.model_config
        self.send(
            Ready(
                summary=engine.summary,
                max_model_len=config.max_model_len,
                vocab_size=config.vocab_size,
                eos_token_ids=sorted(config.eos_token_ids),
                tokenizer=_tokenizer_spec(engine.tokenizer),
                sampling_defaults=sampling_defaults(engine.generation_config),
                vision=engine.vision,
            )
        )
        return True

    def _on_worker_failure(self, reason: str) -> None:
        """Watchdog thread: a worker died. The loop reports it within a poll; if the main thread is
        stuck in a collective that will never finish (NCCL does not notice a dead peer), exit."""
        time.sleep(_WORKER_FAILURE_GRACE_S)
        print(f"fw: error: {reason}; stopping the engine", file=sys.stderr, flush=True)
        self.engine.workers.close()
        os._exit(1)

    def check_workers(self) -> None:
        """Raise if a tensor-parallel worker has exited (the engine cannot step without it)."""
        workers = self.engine.workers if self.engine is not None else None
        reason = workers.failure() if workers is not None else None
        if reason is not None:
            raise RuntimeError(reason)

    def failure_reason(self, error: Exception) -> str:
        """The message for an engine failure: a dead worker's exit explains more than the collective's error."""
        workers = self.engine.workers if self.engine is not None else None
        reason = workers.wait_for_failure(1.0) if workers is not None else None
        return f"the engine failed: {reason or f'{type(error).__name__}: {error}'}"

    def run(self) -> None:
        core = self.core
        while True:
            busy = core.has_unfinished()
            if time.monotonic() - self.last_sent >= HEARTBEAT_INTERVAL_S:
                self.send(Heartbeat())
            if not busy and not self.input.poll(_IDLE_POLL_MS):
                if os.getppid() != self.parent_pid:  # the API process is gone: nobody to serve
                    return
                self.check_workers()
                continue
            while self.input.poll(0):
                if not self.handle(self.decoder.decode(self.input.recv())):
                    return
            if core.has_unfinished():
                self.check_workers()
                outputs = core.step()
                if outputs:
                    self.send(StepOutputs(outputs=outputs))

    def handle(self, message) -> bool:
        """Apply one request message; False means shut down."""
        from framework.errors import FwError, GrammarError, RequestFailedError

        if isinstance(message, AddRequest):
            try:  # add_request raises only FwErrors (RequestFailedError for its own failures)
                images = {"images": message.images} if message.images else {}  # text requests: the plain call
                self.core.add_request(
                    message.request_id, message.prompt_token_ids, message.params, message.pooling, **images
                )
            except FwError as error:
                self.send(
                    AddFailed(
                        request_id=message.request_id,
                        message=str(error),
                        grammar=isinstance(error, GrammarError),
                        internal=isinstance(error, RequestFailedError),
                    )
                )
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                self.core.abort(request_id)
        elif isinstance(message, GetStats):
            self.send(StatsReply(query_id=message.query_id, stats=self.core.stats()))
        elif isinstance(message, Shutdown):
            return False
        return True

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close()
        self.context.term()


def main(argv: list[str]) -> int:
    input_addr, output_addr = argv[1], argv[2]
    args = sys.stdin.buffer.read()  # the EngineArgs, as JSON
    # Ctrl-C reaches the whole process group; the API process decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("FW_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    loop = EngineLoop(input_addr, output_addr)
    try:
        if not loop.load(json.loads(args)):
            return 1
        try:
            loop.run()
        except Exception as error:
            traceback.print_exc()
            loop.send(EngineFailed(message=loop.failure_reason(error)))
            return 1
        return 0
    finally:
        if loop.engine is not None:
            loop.engine.shutdown()
        loop.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
