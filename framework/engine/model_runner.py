"""Turns a scheduled batch into tensors, runs the model, and samples.

Input preparation for ``R`` requests (request ``r`` computes ``n_r`` tokens from position
``c_r``, its ``num_computed_tokens``)::

    input_ids    [T]  the tokens at positions c_r .. c_r + n_r - 1 of each request, concatenated
    positions    [T]  those positions
    slot_mapping [T]  block_ids[p // block_size] * block_size + p % block_size
    cu_seqlens_q [R+1], seq_lens [R] = c_r + n_r, block_table [R, max_blocks]
    state_indices      hybrid models: request r's state slot, and whether it resumes (c_r > 0)

A request samples when its computed tokens reach ``num_tokens`` (the end of its prompt, or
its last generated token); requests in the middle of a chunked prompt do not. A vision model's
steps also get the image embeddings of the image tokens they cover, its M-RoPE positions and
the key ends of bidirectional image spans (:class:`~framework.engine.multimodal_step.MultiModalStep`).

Tensor parallelism: on rank 0 ``broadcast`` sends each step's :class:`StepMessage` (the new
tokens, first position and not yet sent block ids per request, and the hidden rows of every
``compute_logits`` call) before running it; workers replay it with :meth:`execute_message`, so
every rank joins the same collectives in the same order. With async scheduling rank 0 also
broadcasts the sampled ids on the device (``share_sampled``): a placeholder input token then
resolves on every rank from the same tensor.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from framework.attention_backend import AttentionBackend, AttentionMetadata
from framework.distributed.messages import BlockTableSync, StepInput, StepMessage
from framework.distributed.state import broadcast_from_rank0
from framework.engine.multimodal_step import MultiModalStep, is_vision_model
from framework.engine.outputs import LogprobEntry
from framework.engine.request import PLACEHOLDER, Request
from framework.engine.sampler import Sampler, compute_logprobs
from framework.engine.scheduler import ScheduledBatch
from framework.engine.state_cache import StateCache
from framework.engine.transfer import HostCopy, to_device
from framework.forward_context import ForwardContext, forward_context
from framework.kv_cache import KVCache
from framework.ops_linear_attention import StateIndices

if TYPE_CHECKING:
    from framework.engine.cuda_graphs import CUDAGraphRunner
    from framework.engine.structured_outputs import StructuredOutputManager


@dataclass(slots=True)
class SampledToken:
    request: Request
    token_id: int
    logprob: LogprobEntry | None = None
    embedding: list[float] | None = None  # set instead of a token for pooling requests


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward pass and sampling are queued on the device; :meth:`ModelRunner.collect`
    reads its results. ``sampled`` are the requests that sample, in row order; ``results`` holds
    their token ids (and logprobs) on the way to the host; ``pooled`` the finished embeddings."""

    sampled: list[Request]
    results: HostCopy | None
    pooled: list[SampledToken]


@dataclass(slots=True)
class RowPlan:
    """Which hidden rows of a step get logits, decided once for rank 0 and the workers' message.

    ``prompt_logprobs``: (request index, first row, row count) of each piece of a request's rows
    that scores prompt tokens, the first row counted from the request's first row this step; a
    request's rows are cut into pieces of at most ``max_prompt_logprob_rows`` so that no call
    holds full-vocabulary logits for a whole long prompt. ``sampling``: indices of the requests
    that sample (their last row), in batch order.
    """

    prompt_logprobs: list[tuple[int, int, int]]
    sampling: list[int]

    def logits_rows(self, offsets: list[int]) -> list[list[int]]:
        """The hidden rows of each ``compute_logits`` call, in call order."""
        calls = [
            list(range(offsets[index] + first, offsets[index] + first + count))
            for index, first, count in self.prompt_logprobs
        ]
        return calls + ([[offsets[index + 1] - 1 for index in self.sampling]] if self.sampling else [])


class ModelRunner:
    """Owns the model, the KV caches and the sampler for one device.

    A step is :meth:`launch` (inputs, forward, logits, sampling: all queued on the device) then
    :meth:`collect` (the sampled ids read back). The engine may launch step n + 1 before it
    collects step n: a request's input token is then :data:`PLACEHOLDER` on the host and is taken
    on the device from step n's sampled ids (``last_sampled``).
    """

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        kv_caches: list[KVCache],
        block_size: int,
        device: torch.device,
        sampler: Sampler,
        *,
        graph_runner: CUDAGraphRunner | None = None,
        broadcast: Callable[[StepMessage], object] | None = None,
        structured_outputs: StructuredOutputManager | None = None,
        share_sampled: bool = False,
        state_caches: list[StateCache] | None = None,
    ) -> None:
        """``graph_runner``: captured decode graphs (None: eager); ``broadcast``: rank 0 of a
        tensor-parallel group sends each step to the workers with it; ``structured_outputs``: grammar
        masks on the logits (rank 0); ``share_sampled``: see the module docstring; ``state_caches``: the
        per-sequence states of a hybrid model's linear-attention layers (:mod:`~framework.engine.state_cache`)."""
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.state_caches = state_caches or []
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.graph_runner = graph_runner
        self.broadcast = broadcast
        self.block_tables = BlockTableSync()  # what the workers know of each request's block ids
        self.structured_outputs = structured_outputs
        #: the latest sampling step's rows by request id and its token ids, still on the device
        self.last_sampled: tuple[dict[str, int], torch.Tensor] | None = None
        self.step_input_ids: torch.Tensor | None = None  # the current step's input ids, on the device
        #: tensor parallel with async scheduling: rank 0 broadcasts each step's sampled ids on the
        #: device, so the workers' placeholder inputs read them as rank 0's do
        self.share_sampled = share_sampled
        #: rows of logits per prompt-logprob call: 256 rows of a 152k vocabulary are 156 MB in fp32
        self.max_prompt_logprob_rows = 256
        #: a vision model's encoder runs and M-RoPE positions (None for a text model)
        self.multimodal = MultiModalStep(model, device) if is_vision_model(model) else None

    def release_cuda_graphs(self) -> None:
        """Drop the decode graphs and wait for the device (before a tensor-parallel group is left:
        NCCL's teardown waits while captured collectives are alive)."""
        if self.graph_runner is not None:
            self.graph_runner = None
            gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def is_device_usable(self) -> bool:
        """Whether the device still runs work: true after an out-of-memory error, false after a
        fault that poisons the CUDA context (an illegal address, a device-side assert)."""
        if self.device.type != "cuda":
            return True
        try:
            torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001 - any error here means the context is gone
            return False
        return True

    @staticmethod
    def step_inputs(batch: ScheduledBatch) -> list[StepInput]:
        """What each request computes this step: its new tokens, first position and block ids."""
        return [
            StepInput(
                request.token_ids_at(request.num_computed_tokens, request.num_computed_tokens + num_new),
                request.num_computed_tokens,
                request.block_ids,
                request.request_id,
                state_slot=request.state_slot,
            )
            for request, num_new in zip(batch.requests, batch.num_new_tokens)
        ]

    def prepare_inputs(self, inputs: list[StepInput]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``input_ids``, ``positions`` and the attention metadata of one step's requests.

        Everything crosses to the device in two copies (int64: ids, positions, slots; int32:
        cu_seqlens, seq_lens, block table) that do not wait for the device. A request whose last
        input token is :data:`PLACEHOLDER` gets it from ``last_sampled`` on the device.
        """
        bs = self.block_size
        if all(len(item.token_ids) == 1 for item in inputs):  # decode: one token per request
            input_ids = [item.token_ids[0] for item in inputs]
            positions = [item.start for item in inputs]
            slots = [item.block_ids[p // bs] * bs + p % bs for item, p in zip(inputs, positions)]
            seq_lens = [p + 1 for p in positions]
            cu_seqlens = list(range(len(inputs) + 1))
        else:
            input_ids, positions, slots, cu_seqlens, seq_lens = [], [], [], [0], []
            for item in inputs:
                start, num_new, blocks = item.start, len(item.token_ids), item.block_ids
                end = start + num_new
                input_ids.extend(item.token_ids)
                positions.extend(range(start, end))
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
                cu_seqlens.append(cu_seqlens[-1] + num_new)
                seq_lens.append(end)
        from_device: list[tuple[int, str]] = []  # (token row, request id) of placeholder inputs
        for item, row in zip(inputs, itertools.accumulate(len(item.token_ids) for item in inputs)):
            if item.token_ids[-1] == PLACEHOLDER:
                from_device.append((row - 1, item.request_id))
                input_ids[row - 1] = 0
        num_reqs, num_tokens = len(inputs), len(input_ids)
        int32_inputs, max_blocks = self._int32_inputs(cu_seqlens, seq_lens, [item.block_ids for item in inputs])
        host32 = torch.from_numpy(int32_inputs)
        dev64 = to_device(torch.from_numpy(np.array(input_ids + positions + slots, dtype=np.int64)), self.device)
        dev32 = to_device(host32, self.device)
        cu_cpu, lens_cpu = host32[: num_reqs + 1], host32[num_reqs + 1 : 2 * num_reqs + 1]
        table_cpu = host32[2 * num_reqs + 1 :].view(num_reqs, max_blocks)
        metadata = AttentionMetadata(
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            cu_seqlens_q=dev32[: num_reqs + 1],
            seq_lens=dev32[num_reqs + 1 : 2 * num_reqs + 1],
            block_table=dev32[2 * num_reqs + 1 :].view(num_reqs, max_blocks),
            block_table_cpu=table_cpu,
            slot_mapping=dev64[2 * num_tokens :],
            max_query_len=max(len(item.token_ids) for item in inputs),
            max_seq_len=max(seq_lens),
            cu_seqlens_q_cpu=cu_cpu,
            seq_lens_cpu=lens_cpu,
            is_decode_only=num_tokens == num_reqs,
        )
        if self.state_caches:  # a sequence resumes its state once it has computed tokens
            metadata.state_indices = StateIndices.build(
                cu_seqlens, [item.state_slot for item in inputs], [item.start > 0 for item in inputs], self.device
            )
        ids = dev64[:num_tokens]
        if from_device:
            ids = self._ids_from_device(ids, from_device)
        self.step_input_ids = ids
        return ids, dev64[num_tokens : 2 * num_tokens], metadata

    @staticmethod
    def _int32_inputs(cu_seqlens: list[int], seq_lens: list[int], tables: list[list[int]]) -> tuple[np.ndarray, int]:
        """``cu_seqlens``, ``seq_lens`` and the block table padded with 0 to its longest row, in one
        int32 array (numpy reads the Python ints several times faster than ``torch.tensor``), and
        the table's width (``max_blocks``: the longest row's length)."""
        lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        max_blocks = int(lengths.max())
        head = len(cu_seqlens) + len(seq_lens)
        out = np.zeros(head + len(tables) * max_blocks, dtype=np.int32)
        out[: len(cu_seqlens)] = cu_seqlens
        out[len(cu_seqlens) : head] = seq_lens
        flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
        table = out[head:].reshape(len(tables), max_blocks)
        table[np.arange(max_blocks) < lengths[:, None]] = flat
        return out, max_blocks

    def _ids_from_device(self, ids: torch.Tensor, from_device: list[tuple[int, str]]) -> torch.Tensor:
        """``ids`` with the placeholder rows taken from the previous step's sampled ids on the device."""
        assert self.last_sampled is not None, "a placeholder input without a previous sampling step"
        rows_by_id, sampled = self.last_sampled
        dst = [row for row, _ in from_device]
        src = [rows_by_id[request_id] for _, request_id in from_device]
        if dst == src == list(range(ids.shape[0])):  # steady decode: the same requests in the same order
            return sampled[: ids.shape[0]]
        index = to_device(torch.tensor(dst + src, dtype=torch.int64), self.device)
        return ids.index_copy_(0, index[: len(dst)], sampled.index_select(0, index[len(dst) :]))

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, inputs: list[StepInput] | None = None) -> torch.Tensor:
        """Run the model over the batch (``inputs``: its :meth:`step_inputs`, if already built);
        returns hidden states ``[T, hidden]``. Rank 0's steps start here (workers' run
        :meth:`execute_message`); tests wrap it to see the logits (:func:`framework.testing.capture_logits`)."""
        input_ids, positions, metadata = self.prepare_inputs(inputs if inputs is not None else self.step_inputs(batch))
        if self.multimodal is not None and self.multimodal.applies(batch):
            metadata.span_ends = self.multimodal.span_ends(batch)
            positions, embeds = self.multimodal.prepare(batch, input_ids, positions)
            if embeds is not None:
                return self.run_model(input_ids, positions, metadata, embeds)
        return self.run_model(input_ids, positions, metadata)

    @torch.inference_mode()
    def execute_message(self, message: StepMessage) -> None:
        """A tensor-parallel worker's step: the forward pass and the ``compute_logits`` calls of rank 0."""
        inputs = self.block_tables.expand(message.inputs)
        hidden = self.run_model(*self.prepare_inputs(inputs))
        for rows in message.logits_rows:
            self.model.compute_logits(self._take_rows(hidden, self._row_selector(rows)))
        self.last_sampled = None
        if message.sampling:
            token_ids = broadcast_from_rank0(torch.empty(len(message.sampling), dtype=torch.int64, device=self.device))
            self.last_sampled = (
                {inputs[index].request_id: row for row, index in enumerate(message.sampling)},
                token_ids,
            )

    def run_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model (or the decode graph of its bucket) on prepared inputs; ``inputs_embeds``
        (a vision model's step over image tokens) replaces the token embeddings."""
        graphs = self.graph_runner
        if inputs_embeds is None and graphs is not None and graphs.replays(positions, metadata):
            return graphs.run(input_ids, positions, metadata)
        self.backend.prepare(metadata)
        with forward_context(ForwardContext(metadata, self.backend, self.kv_caches, self.state_caches)):
            if inputs_embeds is not None:
                return self.model(input_ids, positions, inputs_embeds)
            return self.model(input_ids, positions)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Forward, prompt logprobs where asked, then sample the requests that reached their end.

        Nothing here waits for the device once the step is decode-only: the sampled ids stay there
        (``last_sampled``) and are copied back behind an event that :meth:`collect` waits on.
        """
        offsets = list(itertools.accumulate(batch.num_new_tokens, initial=0))
        plan = self._plan_rows(batch)
        inputs = self.step_inputs(batch)
        if self.broadcast is not None:
            self.broadcast(
                StepMessage(
                    self.block_tables.compress(inputs),
                    plan.logits_rows(offsets),
                    sampling=plan.sampling if self.share_sampled else [],
                )
            )
        hidden = self.forward(batch, inputs)
        pooled: list[SampledToken] = []
        for index, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            if request.pooling:
                done = request.num_computed_tokens + num_new == request.num_tokens
                embedding = self._pool(request, hidden[offsets[index] : offsets[index + 1]], done)
                if embedding is not None:
                    pooled.append(SampledToken(request, -1, embedding=embedding))
            elif request.sampling_params.prompt_logprobs is not None and request.num_computed_tokens == 0:
                request.prompt_logprobs = [None]  # prompt token 0 has no logprob
        for index, first, count in plan.prompt_logprobs:
            start = offsets[index] + first
            self._prompt_logprobs(batch.requests[index], hidden[start : start + count], first, count)
        self.last_sampled = None
        if not plan.sampling:
            return LaunchedStep([], None, pooled)
        sampling = [batch.requests[index] for index in plan.sampling]
        last_rows = [offsets[index + 1] - 1 for index in plan.sampling]
        grammar = self.structured_outputs
        # filled on the host while the device computes; applied outside any CUDA graph
        bitmask = grammar.prepare_bitmask(sampling) if grammar is not None else None
        last_rows = self._row_selector(last_rows)
        logits = self.model.compute_logits(self._take_rows(hidden, last_rows)).float()
        if bitmask is not None:
            grammar.apply_bitmask(logits, bitmask)
        out = self.sampler(logits, sampling, self._pending_tokens(sampling, last_rows))
        self.last_sampled = ({request.request_id: row for row, request in enumerate(sampling)}, out.token_ids)
        if self.share_sampled:
            broadcast_from_rank0(out.token_ids)
        return LaunchedStep(sampling, HostCopy(out), pooled)

    def _row_selector(self, rows: list[int]) -> slice | torch.Tensor:
        """What takes ``rows`` of a step's tensors without waiting for the device: a slice when
        ``rows`` is ``0..n-1``, else device indices that cross in a pinned copy (``tensor[list]``
        would copy them synchronously, and so stall the host until the queued step has run)."""
        if rows == list(range(len(rows))):
            return slice(0, len(rows))
        return to_device(torch.tensor(rows, dtype=torch.int64), self.device)

    @staticmethod
    def _take_rows(tensor: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
        """``tensor``'s rows picked by a :meth:`_row_selector`."""
        return tensor[rows] if isinstance(rows, slice) else tensor.index_select(0, rows)

    def _pending_tokens(self, sampling: list[Request], last_rows: slice | torch.Tensor) -> torch.Tensor | None:
        """For the sampler's penalties: per sampling row, the id of its last output token where the
        host holds a placeholder (it is this step's input, on the device), else -1; None if no row
        needs it."""
        placeholder = [
            request.sampling_params.needs_penalties and request.output_token_ids[-1:] == [PLACEHOLDER]
            for request in sampling
        ]
        if not any(placeholder):
            return None
        mask = to_device(torch.tensor(placeholder), self.device)
        return torch.where(mask, self._take_rows(self.step_input_ids, last_rows), -1)

    def collect(self, step: LaunchedStep) -> list[SampledToken]:
        """Wait for a launched step's results and return them (sampled tokens, then embeddings)."""
        if step.results is None:
            return step.pooled
        token_ids, logprobs, top_ids, top_lps = (None if t is None else t.tolist() for t in step.results.wait())
        results = [SampledToken(request, token) for request, token in zip(step.sampled, token_ids)]
        if logprobs is not None:
            for row, result in enumerate(results):
                wanted = result.request.sampling_params.logprobs
                if wanted is None:
                    continue
                top = list(zip(top_ids[row][:wanted], top_lps[row][:wanted])) if top_ids else []
                result.logprob = (logprobs[row], top)
        return results + step.pooled

    def _plan_rows(self, batch: ScheduledBatch) -> RowPlan:
        """The prompt-logprob pieces and the sampling requests of ``batch`` (see :class:`RowPlan`)."""
        plan = RowPlan([], [])
        piece = self.max_prompt_logprob_rows
        for index, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            if request.pooling:
                continue
            if request.sampling_params.prompt_logprobs is not None:
                count = self._num_prompt_logprob_rows(request, num_new)
                plan.prompt_logprobs.extend(
                    (index, first, min(piece, count - first)) for first in range(0, count, piece)
                )
            if request.num_computed_tokens + num_new == request.num_tokens:
                plan.sampling.append(index)
        return plan

    @staticmethod
    def _num_prompt_logprob_rows(request: Request, num_new: int) -> int:
        """Rows of this chunk whose logits score a prompt token (position p predicts token p + 1)."""
        start = request.num_computed_tokens
        if start >= request.num_prompt_tokens:
            return 0
        return max(0, min(start + num_new, request.num_prompt_tokens - 1) - start)

    @staticmethod
    def _pool(request: Request, hidden: torch.Tensor, done: bool) -> list[float] | None:
        """Accumulate this chunk's hidden states; at the end of the prompt, the normalized embedding."""
        if request.pooling == "last":
            request.pooled = hidden[-1].float()
        else:
            chunk = hidden.float().sum(0)
            request.pooled = chunk if request.pooled is None else request.pooled + chunk
        if not done:
            return None
        vector = request.pooled / (request.num_prompt_tokens if request.pooling == "mean" else 1)
        return torch.nn.functional.normalize(vector, dim=0).tolist()

    def _prompt_logprobs(self, request: Request, hidden: torch.Tensor, first: int, count: int) -> None:
        """Logprobs of prompt tokens ``start + 1 .. start + count`` from the ``count`` rows of
        ``hidden``, which are the rows from ``first`` of this step's chunk, so ``start`` is
        ``num_computed_tokens + first`` (position p predicts token p + 1). Pieces arrive in order."""
        start = request.num_computed_tokens + first
        stop = start + count
        targets = torch.tensor(request.prompt_token_ids[start + 1 : stop + 1], device=hidden.device)
        logits = self.model.compute_logits(hidden).float()
        result = compute_logprobs(logits, targets, request.sampling_params.prompt_logprobs)
        lps = result.token_logprobs.tolist()
        top_ids = result.top_ids.tolist() if result.top_ids is not None else [[]] * len(lps)
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else [[]] * len(lps)
        for lp, ids, values in zip(lps, top_ids, top_lps):
            request.prompt_logprobs.append((lp, list(zip(ids, values))))
