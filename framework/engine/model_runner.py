"""Turns a scheduled batch into tensors, runs the model, and samples.

Input preparation for ``R`` requests (request ``r`` computes ``n_r`` tokens from position
``c_r``, its ``num_computed_tokens``)::

    input_ids    [T]  the tokens at positions c_r .. c_r + n_r - 1 of each request, concatenated
    positions    [T]  those positions
    slot_mapping [T]  block_ids[p // block_size] * block_size + p % block_size
    cu_seqlens_q [R+1], seq_lens [R] = c_r + n_r, block_table [R, max_blocks]

A request samples when its computed tokens reach ``num_tokens`` (the end of its prompt, or
its last generated token); requests in the middle of a chunked prompt do not.

Tensor parallelism: on rank 0 ``broadcast`` sends each step's :class:`StepMessage` (the new
tokens, first position and not yet sent block ids per request, and the hidden rows of every
``compute_logits`` call) before running it; workers replay it with :meth:`execute_message`, so
every rank joins the same collectives in the same order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from framework.attention_backend import AttentionBackend, AttentionMetadata
from framework.distributed.messages import BlockTableSync, StepInput, StepMessage
from framework.engine.outputs import LogprobEntry
from framework.engine.request import Request
from framework.engine.sampler import Sampler, compute_logprobs
from framework.engine.scheduler import ScheduledBatch
from framework.forward_context import ForwardContext, forward_context


@dataclass(slots=True)
class SampledToken:
    request: Request
    token_id: int
    logprob: LogprobEntry | None = None
    embedding: list[float] | None = None  # set instead of a token for pooling requests


class ModelRunner:
    """Owns the model, the KV caches and the sampler for one device."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, sampler: Sampler) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.graph_runner = None  # a CUDAGraphRunner once decode graphs are captured
        self.structured_outputs = None  # a StructuredOutputManager: grammar masks on the logits
        self.broadcast: Callable[[StepMessage], object] | None = None  # rank 0 of a tensor-parallel group
        self.block_tables = BlockTableSync()  # what the workers know of each request's block ids

    @staticmethod
    def step_inputs(batch: ScheduledBatch) -> list[StepInput]:
        """What each request computes this step: its new tokens, first position and block ids."""
        return [StepInput(request.all_token_ids[request.num_computed_tokens:request.num_computed_tokens + num_new],
                          request.num_computed_tokens, list(request.block_ids), request.request_id)
                for request, num_new in zip(batch.requests, batch.num_new_tokens)]

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Build ``input_ids``, ``positions`` and the attention metadata for ``batch``."""
        return self.prepare_inputs(self.step_inputs(batch))

    def prepare_inputs(self, inputs: list[StepInput]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``input_ids``, ``positions`` and the attention metadata of one step's requests."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        seq_lens = []
        bs = self.block_size
        for item in inputs:
            start, num_new, blocks = item.start, len(item.token_ids), item.block_ids
            end = start + num_new
            input_ids.extend(item.token_ids)
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            cu_seqlens.append(cu_seqlens[-1] + num_new)
            seq_lens.append(end)
        max_blocks = max(len(item.block_ids) for item in inputs)
        table = torch.tensor([item.block_ids + [0] * (max_blocks - len(item.block_ids)) for item in inputs],
                             dtype=torch.int32)
        to = dict(device=self.device)
        cu_cpu = torch.tensor(cu_seqlens, dtype=torch.int32)
        lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        metadata = AttentionMetadata(
            num_reqs=len(inputs),
            num_tokens=len(input_ids),
            cu_seqlens_q=cu_cpu.to(**to),
            seq_lens=lens_cpu.to(**to),
            block_table=table.to(**to),
            block_table_cpu=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, **to),
            max_query_len=max(len(item.token_ids) for item in inputs),
            max_seq_len=max(seq_lens),
            cu_seqlens_q_cpu=cu_cpu,
            seq_lens_cpu=lens_cpu,
            is_decode_only=all(len(item.token_ids) == 1 for item in inputs),
        )
        return (torch.tensor(input_ids, dtype=torch.int64, **to), torch.tensor(positions, dtype=torch.int64, **to), metadata)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run the model over the batch; returns hidden states ``[T, hidden]``."""
        return self.run_model(*self.prepare(batch))

    @torch.inference_mode()
    def execute_message(self, message: StepMessage) -> None:
        """A tensor-parallel worker's step: the forward pass and the ``compute_logits`` calls of rank 0."""
        hidden = self.run_model(*self.prepare_inputs(self.block_tables.expand(message.inputs)))
        for rows in message.logits_rows:
            self.model.compute_logits(hidden[rows])

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The model (or the decode graph of its bucket) on prepared inputs."""
        graphs = self.graph_runner
        if graphs is not None and metadata.is_decode_only and graphs.bucket_for(metadata.num_reqs):
            return graphs.run(input_ids, positions, metadata)
        self.backend.prepare(metadata)
        with forward_context(ForwardContext(metadata, self.backend, self.kv_caches)):
            return self.model(input_ids, positions)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[SampledToken]:
        """Forward, prompt logprobs where asked, then sample the requests that reached their end."""
        offsets = list(itertools.accumulate(batch.num_new_tokens, initial=0))
        if self.broadcast is not None:
            inputs = self.block_tables.compress(self.step_inputs(batch))
            self.broadcast(StepMessage(inputs, self._logits_rows(batch, offsets)))
        hidden = self.forward(batch)
        sampling: list[Request] = []
        last_rows: list[int] = []
        pooled: list[SampledToken] = []
        for index, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            done = request.num_computed_tokens + num_new == request.num_tokens
            if request.pooling:
                embedding = self._pool(request, hidden[offsets[index]:offsets[index + 1]], done)
                if embedding is not None:
                    pooled.append(SampledToken(request, -1, embedding=embedding))
                continue
            if request.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs(request, hidden[offsets[index]:offsets[index + 1]], num_new)
            if done:
                sampling.append(request)
                last_rows.append(offsets[index + 1] - 1)
        if not sampling:
            return pooled
        grammar = self.structured_outputs
        # filled on the host while the device computes; applied outside any CUDA graph
        bitmask = grammar.prepare_bitmask(sampling) if grammar is not None else None
        logits = self.model.compute_logits(hidden[last_rows]).float()
        if bitmask is not None:
            grammar.apply_bitmask(logits, bitmask)
        out = self.sampler(logits, sampling)
        token_ids = out.token_ids.tolist()
        results = [SampledToken(request, token) for request, token in zip(sampling, token_ids)]
        if out.logprobs is not None:
            logprobs = out.logprobs.tolist()
            top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
            top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            for row, result in enumerate(results):
                wanted = result.request.sampling_params.logprobs
                if wanted is None:
                    continue
                top = list(zip(top_ids[row][:wanted], top_lps[row][:wanted])) if top_ids else []
                result.logprob = (logprobs[row], top)
        return results + pooled

    @classmethod
    def _logits_rows(cls, batch: ScheduledBatch, offsets: list[int]) -> list[list[int]]:
        """The hidden rows of each ``compute_logits`` call :meth:`execute` makes, in call order."""
        calls, last_rows = [], []
        for index, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            if request.pooling:
                continue
            if request.sampling_params.prompt_logprobs is not None:
                count = cls._num_prompt_logprob_rows(request, num_new)
                if count:
                    calls.append(list(range(offsets[index], offsets[index] + count)))
            if request.num_computed_tokens + num_new == request.num_tokens:
                last_rows.append(offsets[index + 1] - 1)
        return calls + ([last_rows] if last_rows else [])

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

    def _prompt_logprobs(self, request: Request, hidden: torch.Tensor, num_new: int) -> None:
        """Logprobs of prompt tokens 1.. from this chunk's positions (token 0 gets None)."""
        start = request.num_computed_tokens
        if start >= request.num_prompt_tokens:
            return  # a decode step, or a recompute past the prompt
        if start == 0:
            request.prompt_logprobs = [None]
        # position p predicts token p + 1; only prompt targets count
        count = self._num_prompt_logprob_rows(request, num_new)
        if not count:
            return
        stop = start + count
        targets = torch.tensor(request.prompt_token_ids[start + 1:stop + 1], device=hidden.device)
        logits = self.model.compute_logits(hidden[: stop - start]).float()
        result = compute_logprobs(logits, targets, request.sampling_params.prompt_logprobs)
        lps = result.token_logprobs.tolist()
        top_ids = result.top_ids.tolist() if result.top_ids is not None else [[]] * len(lps)
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else [[]] * len(lps)
        for lp, ids, values in zip(lps, top_ids, top_lps):
            request.prompt_logprobs.append((lp, list(zip(ids, values))))
