"""Turns a scheduled batch into tensors, runs the model, and samples.

Input preparation for ``R`` requests (request ``r`` computes ``n_r`` tokens from position
``c_r``, its ``num_computed_tokens``)::

    input_ids    [T]  the tokens at positions c_r .. c_r + n_r - 1 of each request, concatenated
    positions    [T]  those positions
    slot_mapping [T]  block_ids[p // block_size] * block_size + p % block_size
    cu_seqlens_q [R+1], seq_lens [R] = c_r + n_r, block_table [R, max_blocks]

A request samples when its computed tokens reach ``num_tokens`` (the end of its prompt, or
its last generated token); requests in the middle of a chunked prompt do not.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from framework.attention_backend import AttentionBackend, AttentionMetadata
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

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Build ``input_ids``, ``positions`` and the attention metadata for ``batch``."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        seq_lens = []
        bs = self.block_size
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            start = request.num_computed_tokens
            end = start + num_new
            tokens = request.all_token_ids
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            blocks = request.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            cu_seqlens.append(cu_seqlens[-1] + num_new)
            seq_lens.append(end)
        max_blocks = max(len(r.block_ids) for r in batch.requests)
        table = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in batch.requests]
        to = dict(device=self.device)
        cu_cpu = torch.tensor(cu_seqlens, dtype=torch.int32)
        lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        metadata = AttentionMetadata(
            num_reqs=len(batch),
            num_tokens=len(input_ids),
            cu_seqlens_q=cu_cpu.to(**to),
            seq_lens=lens_cpu.to(**to),
            block_table=torch.tensor(table, dtype=torch.int32, **to),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, **to),
            max_query_len=max(batch.num_new_tokens),
            max_seq_len=max(seq_lens),
            cu_seqlens_q_cpu=cu_cpu,
            seq_lens_cpu=lens_cpu,
            is_decode_only=all(n == 1 for n in batch.num_new_tokens),
        )
        return (torch.tensor(input_ids, dtype=torch.int64, **to), torch.tensor(positions, dtype=torch.int64, **to), metadata)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run the model over the batch; returns hidden states ``[T, hidden]``."""
        input_ids, positions, metadata = self.prepare(batch)
        graphs = self.graph_runner
        if graphs is not None and metadata.is_decode_only and graphs.bucket_for(metadata.num_reqs):
            return graphs.run(input_ids, positions, metadata)
        self.backend.prepare(metadata)
        with forward_context(ForwardContext(metadata, self.backend, self.kv_caches)):
            return self.model(input_ids, positions)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[SampledToken]:
        """Forward, prompt logprobs where asked, then sample the requests that reached their end."""
        hidden = self.forward(batch)
        offsets = list(itertools.accumulate(batch.num_new_tokens, initial=0))
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
        stop = min(start + num_new, request.num_prompt_tokens - 1)
        if stop <= start:
            return
        targets = torch.tensor(request.prompt_token_ids[start + 1:stop + 1], device=hidden.device)
        logits = self.model.compute_logits(hidden[: stop - start]).float()
        result = compute_logprobs(logits, targets, request.sampling_params.prompt_logprobs)
        lps = result.token_logprobs.tolist()
        top_ids = result.top_ids.tolist() if result.top_ids is not None else [[]] * len(lps)
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else [[]] * len(lps)
        for lp, ids, values in zip(lps, top_ids, top_lps):
            request.prompt_logprobs.append((lp, list(zip(ids, values))))
