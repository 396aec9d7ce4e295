"""Structured outputs: grammar-constrained decoding with xgrammar.

A request whose ``SamplingParams.structured_outputs`` is set gets a grammar (JSON schema, regex,
EBNF, choice). The :class:`StructuredOutputManager` owns everything grammar-related::

    add_request   parse the grammar (GrammarError if it is invalid), start compiling it against
                  the model's vocabulary on a worker thread; compiled grammars are cached by
                  (kind, spec), so the same schema compiles once
    pop_ready     requests whose grammar finished compiling: the engine schedules them only
                  then, so a slow compile never blocks the other requests; those whose compile
                  failed, or did not finish within ``compile_timeout_s`` of the request's
                  arrival, come back with the error (the engine finishes them with it)
    release       a finished or aborted request drops its grammar state; a compile that only it
                  was waiting for and that has not started yet is cancelled
    prepare_bitmask / apply_bitmask
                  per step, before sampling: one bit per vocabulary token for each row, filled on
                  the host by the row's GrammarMatcher (all ones for unconstrained rows), copied
                  to the device once and applied to the logits in place (disallowed -> -inf)
    accept_token  advance the matcher with the sampled token; True when the grammar has ended
                  (it accepted a stop token) and the request should finish with "stop"

``start_after`` (e.g. ``"</think>"``): the matcher stays off until the generated text contains
that string; the grammar then constrains every later token (text that shares a token with the
end of the marker is not constrained).

Preemption recomputes the KV cache of tokens already generated and never re-samples them, so a
matcher's state stays valid across it; an aborted or finished request drops its matcher.
xgrammar (which imports transformers) is imported on the first structured request.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from framework.engine.transfer import to_device
from framework.errors import ConfigError, GrammarError
from framework.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from framework.engine.request import Request
    from framework.tokenizer import Tokenizer

log = logging.getLogger("fw.engine")

#: xgrammar prefixes its errors with "[time] /path/file.cc:line: "; users need only the message.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
#: Seconds a request waits for its grammar to compile before it fails.
COMPILE_TIMEOUT_S = 30.0


def build_grammar(params: StructuredOutputsParams) -> Any:
    """The ``xgrammar.Grammar`` for ``params``; raises GrammarError naming the field when it is invalid.

    JSON is generated compactly (``{"a": 1, "b": [2, 3]}``) with no free whitespace: small
    models otherwise tend to loop on whitespace. Schemas are strict (no properties or items
    beyond those the schema names), as OpenAI's ``strict: true`` asks.
    """
    import xgrammar

    kind = params.kind
    try:
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
        if kind == "json_object":
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return xgrammar.Grammar.from_regex(params.regex)
        if kind == "grammar":
            return xgrammar.Grammar.from_ebnf(params.grammar)
        # choice: one EBNF string literal per option (JSON string escapes are EBNF escapes)
        options = " | ".join(json.dumps(option, ensure_ascii=False) for option in params.choice)
        return xgrammar.Grammar.from_ebnf(f"root ::= {options}")
    except (RuntimeError, ValueError, TypeError) as error:
        message = _xgrammar_message(error)
        what = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar"}.get(kind, kind)
        raise GrammarError(f"structured_outputs.{kind}: invalid {what}: {message}") from None


def compile_error_message(params: StructuredOutputsParams, error: BaseException) -> str:
    """What a client is told when its grammar parsed but failed to compile (or the model's
    vocabulary could not be read by xgrammar): the field, as :func:`build_grammar` names it."""
    return f"structured_outputs.{params.kind}: the grammar failed to compile: {_xgrammar_message(error)}"


def _xgrammar_message(error: BaseException) -> str:
    """xgrammar's error text without its source-location prefix (the exception's type if empty)."""
    return _XGRAMMAR_PREFIX.sub("", str(error).strip()) or type(error).__name__


class TokenBitmask(NamedTuple):
    """One step's mask: ``bitmask`` [rows, ceil(vocab / 32)] int32 on the logits' device (bit set =
    allowed; rows without an active grammar are all ones) and the rows that have a grammar."""

    bitmask: torch.Tensor
    active_rows: list[int]


@dataclass(slots=True, eq=False)
class StructuredOutputState:
    """One request's grammar: its compile future, then its matcher; plain data."""

    compiled: Future
    start_after: str | None = None
    submitted: float = 0.0  # time.monotonic() when the request asked for the grammar
    matcher: Any = None  # xgrammar.GrammarMatcher, created when the request first samples
    is_active: bool = True  # False until ``start_after`` has been generated
    recent_text: str = ""  # the end of the generated text, while looking for ``start_after``
    decoder: Any = None  # tokenizers DecodeStream, while looking for ``start_after``


class StructuredOutputManager:
    """Compiles, caches and applies grammars for one engine (see the module docstring).

    ``vocab_size`` is the width of the model's logits (it may exceed the tokenizer's
    vocabulary: the extra ids are never allowed); ``stop_token_ids`` end a grammar (EOS).
    Grammars compile on a pool of ``compile_workers`` threads, so one slow grammar does not
    hold up every other; a request whose grammar is not compiled ``compile_timeout_s`` after
    it arrived fails (the compile itself cannot be interrupted and may finish for later ones).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        stop_token_ids: list[int],
        device: torch.device,
        max_cached_grammars: int = 256,
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
        compile_workers: int = 2,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.device = device
        self.max_cached_grammars = max_cached_grammars
        self.compile_timeout_s = compile_timeout_s
        self.compile_workers = compile_workers
        self._executor: ThreadPoolExecutor | None = None
        self._compiler: Future | None = None  # -> xgrammar.GrammarCompiler
        self._grammars: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._compiling: list[Request] = []
        self._bitmask: torch.Tensor | None = None

    # --- requests ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Parse the request's grammar (GrammarError if invalid) and start compiling it."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        if self._compiler is not None and self._compiler.done() and self._compiler.exception() is not None:
            raise ConfigError(f"structured outputs are unavailable for this model: {self._compiler.exception()}")
        key = (params.kind, params.spec)
        compiled = self._grammars.get(key)
        if compiled is None or (compiled.done() and compiled.exception() is not None):
            compiled = self._submit(self._compile, build_grammar(params))  # a cached key was valid already
            self._grammars[key] = compiled
            while len(self._grammars) > self.max_cached_grammars:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        state = StructuredOutputState(compiled, params.start_after, submitted=time.monotonic())
        if params.start_after:
            from tokenizers.decoders import DecodeStream

            state.is_active = False
            state.decoder = DecodeStream(skip_special_tokens=False)
        request.structured_output = state
        self._compiling.append(request)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def pop_ready(self, timeout_s: float = 0.0) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose grammar is compiled, and (request, error) for those whose compile failed.

        With ``timeout_s`` it waits that long for a first compile to finish (the engine does when
        it has nothing else to run).
        """
        if not self._compiling:
            return [], []
        if timeout_s > 0:
            wait_futures([r.structured_output.compiled for r in self._compiling], timeout_s, "FIRST_COMPLETED")
        ready, failed, waiting = [], [], []
        now = time.monotonic()
        for request in self._compiling:
            state = request.structured_output
            compiled = state.compiled
            if not compiled.done() and now - state.submitted > self.compile_timeout_s:
                params = request.sampling_params.structured_outputs
                failed.append(
                    (
                        request,
                        f"structured_outputs.{params.kind}: the grammar did not compile within "
                        f"{self.compile_timeout_s:g} s; simplify it",
                    )
                )
                request.structured_output = None
            elif not compiled.done():
                waiting.append(request)
            elif compiled.exception() is not None:
                failed.append(
                    (request, compile_error_message(request.sampling_params.structured_outputs, compiled.exception()))
                )
                request.structured_output = None
            else:
                ready.append(request)
        self._compiling = waiting
        for request, _ in failed:
            self._cancel_unwanted(request.sampling_params.structured_outputs)
        return ready, failed

    def _cancel_unwanted(self, params: StructuredOutputsParams) -> None:
        """Cancel the compile of ``params`` if it has not started and no waiting request needs it."""
        key = (params.kind, params.spec)
        compiled = self._grammars.get(key)
        if compiled is None or any(r.structured_output.compiled is compiled for r in self._compiling):
            return
        if compiled.cancel():
            del self._grammars[key]

    def release(self, request: Request) -> None:
        """Forget the request's grammar state (finished or aborted)."""
        if request.structured_output is not None and request in self._compiling:
            self._compiling.remove(request)
            request.structured_output = None
            self._cancel_unwanted(request.sampling_params.structured_outputs)
        request.structured_output = None

    # --- each step -----------------------------------------------------------------------
    def prepare_bitmask(self, rows: list[Request]) -> TokenBitmask | None:
        """The allowed-token bitmask of ``rows`` (the requests sampling this step, in order) on
        the device, or None when no row has an active grammar (then xgrammar is never imported)."""
        active = [
            i
            for i, request in enumerate(rows)
            if request.structured_output is not None and request.structured_output.is_active
        ]
        if not active:
            return None
        import xgrammar

        bitmask = self._host_bitmask(len(rows))
        active_set = set(active)
        for i, request in enumerate(rows):
            if i in active_set:
                state = request.structured_output
                if state.matcher is None:
                    state.matcher = xgrammar.GrammarMatcher(state.compiled.result())
                state.matcher.fill_next_token_bitmask(bitmask, i)
            else:
                bitmask[i].fill_(-1)  # all ones: every token allowed
        rows_mask = bitmask[: len(rows)]
        if self.device.type != "cpu":
            rows_mask = rows_mask.to(self.device, non_blocking=True)
        return TokenBitmask(rows_mask, active)

    def apply_bitmask(self, logits: torch.Tensor, mask: TokenBitmask) -> None:
        """Set the logits of disallowed tokens to -inf, in place (on the logits' device)."""
        import xgrammar

        vocab_size = min(self.vocab_size, logits.shape[-1])
        xgrammar.apply_token_bitmask_inplace(logits, mask.bitmask, vocab_size=vocab_size)
        if logits.shape[-1] > vocab_size:  # padded logits: ids past the vocabulary are never allowed
            rows = to_device(torch.tensor(mask.active_rows), logits.device)
            logits[rows, vocab_size:] = float("-inf")

    def accept_token(self, request: Request, token_id: int) -> bool:
        """Advance the request's grammar with its sampled token; True if the grammar has ended."""
        state = request.structured_output
        if not state.is_active:
            self._look_for_start(state, token_id)
            return False
        if state.matcher is None:  # cannot happen: an active request samples with a matcher
            return False
        if not state.matcher.accept_token(token_id):
            log.warning(
                "request %s: token %d is outside its grammar (a min_tokens or logit_bias setting may "
                "have left no allowed token); finishing it",
                request.request_id,
                token_id,
            )
            return True
        return state.matcher.is_terminated()

    # --- internals -----------------------------------------------------------------------
    def _look_for_start(self, state: StructuredOutputState, token_id: int) -> None:
        piece = state.decoder.step(self.tokenizer.backend, token_id) or ""
        text = state.recent_text + piece
        if state.start_after in text:
            state.is_active, state.decoder, state.recent_text = True, None, ""
        else:
            state.recent_text = text[-len(state.start_after) :]

    def _host_bitmask(self, num_rows: int) -> torch.Tensor:
        import xgrammar

        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            shape = xgrammar.get_bitmask_shape(max(num_rows, 8), self.vocab_size)
            pin = self.device.type == "cuda"
            self._bitmask = torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)
        return self._bitmask

    def _submit(self, fn, *args) -> Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.compile_workers, thread_name_prefix="fw-grammar")
            self._compiler = self._executor.submit(self._make_compiler)
        return self._executor.submit(fn, *args)

    def _make_compiler(self) -> Any:
        """The xgrammar compiler for this model's vocabulary (runs once, on the worker thread)."""
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
        )
        # the manager keeps its own LRU of compiled grammars; xgrammar's cache would be unbounded
        return xgrammar.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False)

    def _compile(self, grammar: Any) -> Any:
        return self._compiler.result().compile_grammar(grammar)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
