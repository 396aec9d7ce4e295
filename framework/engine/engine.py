"""The engine core: ``add_request / step / abort`` over the scheduler and the model runner.

It deals in token ids only; text (templates, detokenization, stop strings) belongs to the
caller (:class:`framework.llm.LLM` in-process, the API process when serving).

A step that raises fails the requests of that step (and of the step still in flight), not the
engine: each gets an output with an ``error`` and its blocks and grammar state are freed. Only
when the device is no longer usable (or a tensor-parallel group may be out of step) does the
error leave :meth:`EngineCore.step`.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from framework.config import EngineConfig
from framework.engine.kv_cache_manager import KVCacheManager
from framework.engine.model_runner import LaunchedStep, ModelRunner
from framework.engine.multimodal_step import attach_images, longest_bidirectional_span, request_images
from framework.engine.outputs import GRAMMAR_FAILED, OUT_OF_MEMORY, STEP_FAILED, EngineStats, RequestOutput
from framework.engine.request import PLACEHOLDER, FinishReason, Request, RequestStatus
from framework.engine.sampler import make_generator
from framework.engine.scheduler import ScheduledBatch, Scheduler
from framework.engine.state_cache import StateSlotManager
from framework.engine.structured_outputs import StructuredOutputManager
from framework.errors import ConfigError, FwError, RequestFailedError
from framework.multimodal.inputs import ImageInput
from framework.sampling_params import SamplingParams

log = logging.getLogger("fw.engine")

POOLING_TYPES = (None, "mean", "last")


@dataclass(slots=True)
class InflightStep:
    """A launched step not yet read back: its batch, the runner's handle, and for each sampling
    request the index in ``output_token_ids`` of the placeholder its token replaces."""

    requests: list[Request]
    launched: LaunchedStep
    indices: list[int]


class EngineCore:
    """Continuous batching over one model. Not thread-safe: one caller drives ``step``.

    ``async_scheduling`` launches each step before the previous one is read back (see
    :meth:`step`); it changes when outputs are reported, never what they are.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        kv_cache: KVCacheManager,
        structured_outputs: StructuredOutputManager | None = None,
        async_scheduling: bool = False,
        state_slots: StateSlotManager | None = None,
    ) -> None:
        """``state_slots``: a hybrid model's state-cache slots (see :class:`Scheduler`)."""
        self.config = config
        self.async_scheduling = async_scheduling
        self.inflight: InflightStep | None = None
        self.runner = runner
        self.kv_cache = kv_cache
        self.structured_outputs = structured_outputs  # None: requests with structured_outputs are refused
        self.scheduler = Scheduler(config.scheduler, kv_cache, state_slots)
        self.requests: dict[str, Request] = {}
        self.scheduled: list[Request] = []  # the batch of the step being run (failed with it if it raises)
        self.num_failed_steps = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    # --- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        pooling: str | None = None,
        images: list[ImageInput] | None = None,
    ) -> None:
        """Queue a request; raises ConfigError (with the limits) if it can never be served.

        With ``pooling`` (``"mean"`` or ``"last"``) the request is an embedding: the prompt is
        run once and its output carries the L2-normalized pooled hidden state, no tokens.
        With ``params.structured_outputs`` an invalid grammar raises ConfigError here; a valid
        one compiles in the background and the request is scheduled once it is ready. Any other
        failure is logged and raised as :class:`RequestFailedError`; the request is then not queued.
        ``images``: the prompt's preprocessed images, whose placeholder spans lie in
        ``prompt_token_ids`` (:mod:`framework.multimodal`); ConfigError for a model without vision.
        """
        try:
            self._add_request(request_id, prompt_token_ids, params, pooling, images)
        except FwError:
            raise
        except Exception as error:
            log.exception("request %s could not be added", request_id)
            raise RequestFailedError(
                f"the engine could not add the request ({type(error).__name__}); the error is in the server log"
            ) from error

    def _add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        pooling: str | None,
        images: list[ImageInput] | None = None,
    ) -> None:
        if pooling not in POOLING_TYPES:
            raise ConfigError(f"unknown pooling {pooling!r}; valid: mean, last")
        if request_id in self.requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        model = self.config.model
        if not prompt_token_ids:
            raise ConfigError("the prompt is empty: give at least one token")
        vocab = model.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        capacity = self.kv_cache.num_blocks * self.kv_cache.block_size
        if len(prompt_token_ids) >= capacity:
            raise ConfigError(
                f"the prompt has {len(prompt_token_ids)} tokens but the KV cache holds {capacity}; "
                "start the server with a larger --mem / --kv-fraction, or send a shorter prompt"
            )
        if pooling and len(prompt_token_ids) > model.max_model_len:
            raise ConfigError(
                f"the input has {len(prompt_token_ids)} tokens; this model's context length is {model.max_model_len}"
            )
        if not pooling and len(prompt_token_ids) >= model.max_model_len:
            raise ConfigError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context length is "
                f"{model.max_model_len}, which must leave room for at least one generated token"
            )
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            eos_token_ids=model.eos_token_ids,
            max_model_len=min(model.max_model_len, capacity),
            pooling=pooling,
        )
        if images:
            if self.runner.broadcast is not None:
                raise ConfigError(
                    "images are not supported with tensor parallelism yet; serve this model on one device"
                )
            placed = request_images(self.runner.model, request.prompt_token_ids, images)
            longest, budget = longest_bidirectional_span(placed), self.scheduler.config.max_num_batched_tokens
            if longest > budget:
                raise ConfigError(
                    f"an image takes {longest} tokens that one step must compute together; "
                    f"max_num_batched_tokens is {budget}: raise it to at least {longest}"
                )
            attach_images(self.runner.model, request, placed)
        if params.seed is not None:
            request.generator = make_generator(params.seed, self.runner.device)
        if params.structured_outputs is not None and not pooling:
            if self.structured_outputs is None:
                raise ConfigError("this engine was built without structured outputs support")
            self.structured_outputs.add_request(request)  # waits in the manager until compiled
        else:
            self.scheduler.add(request)
        self.requests[request_id] = request

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._retire(request, FinishReason.ABORT)
        return True

    def _retire(self, request: Request, reason: FinishReason, cache_blocks: bool = True) -> None:
        """Finish ``request``: key its full blocks for the prefix cache (unless a failed step may
        have left them half written), free them, forget the request."""
        if cache_blocks:
            self.kv_cache.cache_full_blocks(request)  # its computed tokens are real: placeholders are never computed
        self.scheduler.finish(request, reason)
        self.requests.pop(request.request_id, None)
        if self.structured_outputs is not None:
            self.structured_outputs.release(request)

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_work()
            or self.inflight is not None
            or (self.structured_outputs is not None and self.structured_outputs.num_compiling > 0)
        )

    # --- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, and report what each request produced.

        With async scheduling the step launched here is read back by the next call, after that
        call has launched its own step, so the host prepares step n + 1 while the device runs
        step n::

            call k:  [drain n-1 if it cannot overlap] schedule n ─ launch n ─ collect n-1 ─ return n-1
            device:                         ... step n-1 ... │ step n ...

        A step overlaps its predecessor only when the batch is certain: nothing waits, every
        running request decodes the token the previous step sampled (left on the device; the
        penalties count it there), none has a grammar (xgrammar needs the token on the host), and
        every request can get a block without preemption. Otherwise the previous step is read
        back first. A request whose last token (by length) is in flight is not scheduled again;
        one that stops by EOS or a stop token had one more step launched, whose result is dropped.

        If anything raises, the requests of the failed step and of the step in flight finish with
        an error output (see :meth:`_fail_step`); the error propagates only when the engine cannot
        go on (:meth:`_can_recover`).
        """
        outputs: list[RequestOutput] = []
        try:
            self._step(outputs)
        except Exception as error:
            if not self._can_recover():
                raise
            outputs += self._fail_step(error)
        finally:
            self.scheduled = []
        return outputs

    def _step(self, outputs: list[RequestOutput]) -> None:
        """:meth:`step`'s work, appending to ``outputs`` as it goes (so a failure keeps what was reported)."""
        if self.structured_outputs is not None:
            outputs += self._admit_compiled()
        if self.inflight is not None and not self._can_overlap():
            self._finish(self.inflight, outputs)
            self.inflight = None
        batch = self.scheduler.schedule()
        self.scheduled = batch.requests
        launched = self._launch(batch) if batch.requests else None
        if self.inflight is not None:
            self._finish(self.inflight, outputs)
        self.inflight = launched
        if launched is not None and not self.async_scheduling:
            self._finish(launched, outputs)
            self.inflight = None

    def _can_recover(self) -> bool:
        """Whether the engine may go on after a failed step: not with a tensor-parallel group (the
        workers may be inside a collective rank 0 left) nor on a device that no longer runs work."""
        return self.runner.broadcast is None and self.runner.is_device_usable()

    def _fail_step(self, error: Exception) -> list[RequestOutput]:
        """Finish every unfinished request of the failed step and of the step in flight with an
        error output; free their blocks (not keyed for the prefix cache) and grammar state."""
        self.num_failed_steps += 1
        log.error("a step failed; its requests are given up", exc_info=error)
        out_of_memory = isinstance(error, torch.OutOfMemoryError)
        if out_of_memory:
            message, kind = "the device ran out of memory while running this request; retry it later", OUT_OF_MEMORY
        else:
            message = (
                f"the engine failed while running this request ({type(error).__name__}); the error is in the server log"
            )
            kind = STEP_FAILED
        failed = {id(request): request for request in (self.inflight.requests if self.inflight is not None else [])}
        failed.update((id(request), request) for request in self.scheduled)
        self.inflight = None
        self.runner.last_sampled = None  # the failed step's ids: no placeholder may read them
        outputs = []
        for request in failed.values():
            if request.status is RequestStatus.FINISHED:
                continue
            self._retire(request, FinishReason.ABORT, cache_blocks=False)
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason="abort",
                    num_prompt_tokens=request.num_prompt_tokens,
                    error=message,
                    error_kind=kind,
                )
            )
        if out_of_memory and self.runner.device.type == "cuda":
            torch.cuda.empty_cache()  # give what the failed step held back to the next one
        return outputs

    def _can_overlap(self) -> bool:
        """Whether the next step may be launched before the one in flight is read back (see :meth:`step`)."""
        if self.scheduler.waiting or self.kv_cache.num_free_blocks < len(self.scheduler.running):
            return False
        in_flight = {id(request) for request in self.inflight.launched.sampled}
        for request in self.scheduler.running:
            if id(request) not in in_flight or request.structured_output is not None:
                return False
        return True

    def _launch(self, batch: ScheduledBatch) -> InflightStep:
        """Launch ``batch`` on the runner; each sampling request gets a placeholder for its token."""
        launched = self.runner.launch(batch)
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            if request.num_computed_tokens < request.num_prompt_tokens:
                self.num_prompt_tokens += min(num_new, request.num_prompt_tokens - request.num_computed_tokens)
            request.num_computed_tokens += num_new
        indices = []
        for request in launched.sampled:
            indices.append(request.num_output_tokens)
            request.output_token_ids.append(PLACEHOLDER)
        return InflightStep(batch.requests, launched, indices)

    def _finish(self, step: InflightStep, outputs: list[RequestOutput]) -> None:
        """Read a launched step back: fill its placeholders, check stops, append the outputs."""
        for item, index in itertools.zip_longest(self.runner.collect(step.launched), step.indices):
            request = item.request
            if request.status is RequestStatus.FINISHED:
                continue  # aborted, or stopped while this step was in flight: its result is dropped
            if item.embedding is not None:
                self._retire(request, FinishReason.STOP)
                outputs.append(
                    RequestOutput(
                        request_id=request.request_id,
                        new_token_ids=[],
                        finish_reason="stop",
                        num_prompt_tokens=request.num_prompt_tokens,
                        embedding=item.embedding,
                    )
                )
                continue
            request.output_token_ids[index] = item.token_id
            self.num_generation_tokens += 1
            reason = request.check_stop(index)
            if request.structured_output is not None and self.structured_outputs.accept_token(request, item.token_id):
                reason = reason or FinishReason.STOP  # the grammar is complete
            output = RequestOutput(
                request_id=request.request_id,
                new_token_ids=[item.token_id],
                new_logprobs=[item.logprob] if item.logprob is not None else None,
                prompt_logprobs=request.prompt_logprobs
                if index == 0 and request.sampling_params.prompt_logprobs is not None
                else None,
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=max(request.num_cached_tokens, 0),
            )
            if reason is not None:
                del request.output_token_ids[index + 1 :]  # the placeholder of a step launched since
                self._retire(request, reason)
                output.finish_reason = reason.value
                output.stop_token_id = request.stop_token_id
            outputs.append(output)
        if self.kv_cache.enable_prefix_caching:  # (cache_full_blocks checks too; this skips the loop)
            for request in step.requests:
                if request.status is not RequestStatus.FINISHED:
                    self.kv_cache.cache_full_blocks(request)  # their computed tokens are all real now

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar compiled; those whose compile failed finish ("abort")
        with the compiler's message as their output's ``error`` (they never held KV blocks)."""
        manager = self.structured_outputs
        if not manager.num_compiling:
            return []
        ready, failed = manager.pop_ready(timeout_s=0.0 if self.scheduler.has_work() else 0.05)
        for request in ready:
            self.scheduler.add(request)
        outputs = []
        for request, message in failed:
            log.error("request %s: %s", request.request_id, message)
            self._retire(request, FinishReason.ABORT)  # in no queue and holding no blocks yet
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason="abort",
                    num_prompt_tokens=request.num_prompt_tokens,
                    error=message,
                    error_kind=GRAMMAR_FAILED,
                )
            )
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.kv_cache.num_free_blocks,
            num_blocks=self.kv_cache.num_blocks,
            kv_cache_usage=self.kv_cache.usage,
            prefix_cache_queries=self.kv_cache.num_queried_tokens,
            prefix_cache_hits=self.kv_cache.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens,
            num_failed_steps=self.num_failed_steps,
        )

    def run_until_done(self, timeout_s: float | None = None) -> list[RequestOutput]:
        """Step until no request is left (tests, offline use); returns every output in order."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        outputs: list[RequestOutput] = []
        while self.has_unfinished():
            outputs.extend(self.step())
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("engine did not finish in time")
        return outputs
