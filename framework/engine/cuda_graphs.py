"""CUDA graphs for decode steps: one graph per batch-size bucket, one shared memory pool.

A decode-only step of ``n`` requests replays the graph of the smallest bucket ``>= n``. Inputs
are copied into static buffers; rows beyond ``n`` are padding that writes its K/V into a
reserved sink block and attends to one token, so it is harmless::

    static rows  [ r0 r1 ... r(n-1) | pad ... pad ]   bucket size B >= n
    slot_mapping [ real slots       | sink slots  ]
    seq_lens     [ real lengths     | 1 ...       ]
    state slots  [ real slots       | spare slot  ]   hybrid models: padding updates the spare
                                                      state row, starting from zeros

The attention backend must declare ``supports_cuda_graphs``: its forward may not read host
tensors or sync, and ``max_seq_len`` is the model's context length (an upper bound) inside the
graph.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch
from torch import nn

from framework.attention_backend import AttentionBackend, AttentionMetadata
from framework.forward_context import ForwardContext, forward_context
from framework.kv_cache import KVCache
from framework.ops_linear_attention import StateIndices

log = logging.getLogger("fw.engine")


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_num_seqs`` (vLLM's sizes)."""
    sizes = [size for size in (1, 2, 4) if size < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class CUDAGraphRunner:
    """Captures and replays decode steps of ``model`` on ``backend``."""

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        kv_caches: list[KVCache],
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        sink_block: int,
        device: torch.device,
        state_caches: list | None = None,
        spare_state_slot: int = 0,
    ) -> None:
        """``state_caches``: a hybrid model's per-sequence states; ``spare_state_slot`` is their row
        reserved for padding rows (one past the slots handed out)."""
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.state_caches, self.spare_state_slot = state_caches or [], spare_state_slot
        self.buckets = batch_buckets(max_num_seqs)
        self.max_model_len, self.block_size, self.sink_block = max_model_len, block_size, sink_block
        size, width = self.buckets[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), sink_block * block_size, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_table = torch.full((size, width), sink_block, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(size + 1, dtype=torch.int32, device=device)
        # decode rows are 0..size-1; padding rows update the spare state row from zeros
        self.state_rows = torch.arange(size, dtype=torch.int64, device=device)
        self.state_slots = torch.full((size,), spare_state_slot, dtype=torch.int64, device=device)
        self.state_resumes = torch.zeros(size, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        #: the backend plans on the host each step (FlashInfer), so replays are prepared too
        self.backend_plans = type(backend).prepare is not AttentionBackend.prepare
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _metadata(
        self, size: int, seq_lens_cpu: torch.Tensor | None = None, block_table_cpu: torch.Tensor | None = None
    ) -> AttentionMetadata:
        """The static buffers' metadata for ``size`` rows; host copies where a backend plans."""
        metadata = AttentionMetadata(
            num_reqs=size,
            num_tokens=size,
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            cu_seqlens_q_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.ones(size, dtype=torch.int32) if seq_lens_cpu is None else seq_lens_cpu,
            is_decode_only=True,
            graph_batch_size=size,
            block_table_cpu=torch.full((size, 1), self.sink_block, dtype=torch.int32)
            if block_table_cpu is None
            else block_table_cpu,
        )
        if self.state_caches:  # the host lists are placeholders: a decode step reads the device rows
            metadata.state_indices = StateIndices(
                list(range(size + 1)),
                [self.spare_state_slot] * size,
                [False] * size,
                self.state_rows[:size],
                self.state_slots[:size],
                self.state_resumes[:size],
                [],
                self.state_rows[:0].view(0, 4),
            )
        return metadata

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the static buffers (the backend was prepared before, outside any capture)."""
        metadata = self._metadata(size)
        with forward_context(ForwardContext(metadata, self.backend, self.kv_caches, self.state_caches)):
            return self.model(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def capture(self) -> tuple[float, int]:
        """Capture every bucket, largest first (so smaller ones reuse its pool); returns (seconds, bytes)."""
        started, before = time.perf_counter(), torch.cuda.memory_allocated()
        for size in reversed(self.buckets):
            self.backend.prepare(self._metadata(size))
            self._forward(size)  # warm-up: kernel compilation and autotuning stay out of the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self._forward(size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        return time.perf_counter() - started, torch.cuda.memory_allocated() - before

    def bucket_for(self, num_reqs: int) -> int | None:
        return next((size for size in self.buckets if size >= num_reqs), None)

    def replays(self, positions: torch.Tensor, metadata: AttentionMetadata) -> int | None:
        """The bucket whose graph runs this step, or None (run it eagerly): a decode-only step of at
        most the largest bucket's requests, with ``[T]`` positions as captured. M-RoPE's ``[3, T]``
        positions come with prompt tokens of a prompt with images, which a decode-only step also
        has when each request's next chunk is its prompt's last token."""
        if not metadata.is_decode_only or positions.dim() != 1:
            return None
        return self.bucket_for(metadata.num_reqs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Replay the bucket for a step that it :meth:`replays`; returns hidden states of the real rows."""
        num = metadata.num_reqs
        size = self.replays(positions, metadata)
        assert size is not None
        self.input_ids[:num].copy_(input_ids, non_blocking=True)
        self.positions[:num].copy_(positions, non_blocking=True)
        self.slot_mapping[:num].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:num].copy_(metadata.seq_lens, non_blocking=True)
        width = metadata.block_table.shape[1]
        self.block_table[:num, :width].copy_(metadata.block_table, non_blocking=True)
        if self.state_caches:
            self.state_slots[:num].copy_(metadata.state_indices.decode_slots, non_blocking=True)
            self.state_resumes[:num].copy_(metadata.state_indices.decode_has_initial_state, non_blocking=True)
        if num < size:  # padding rows: sink slot, one token of context (and the spare state row)
            self.slot_mapping[num:size].fill_(self.sink_block * self.block_size)
            self.seq_lens[num:size].fill_(1)
            self.block_table[num:size, 0].fill_(self.sink_block)
            if self.state_caches:
                self.state_slots[num:size].fill_(self.spare_state_slot)
                self.state_resumes[num:size].zero_()
        if self.backend_plans:
            self.backend.prepare(self._padded_host_metadata(metadata, size))
        self.graphs[size].replay()
        return self.outputs[size][:num]

    def _padded_host_metadata(self, metadata: AttentionMetadata, size: int) -> AttentionMetadata:
        """The replayed step's metadata padded to ``size`` rows on the host: padding rows hold one
        token in the sink block, as the static device buffers do."""
        num = metadata.num_reqs
        seq_lens = torch.ones(size, dtype=torch.int32)
        seq_lens[:num] = metadata.seq_lens_cpu
        table = metadata.host_block_table()
        block_table = torch.full((size, table.shape[1]), self.sink_block, dtype=torch.int32)
        block_table[:num] = table
        return self._metadata(size, seq_lens, block_table)


class CapturedGraphs(NamedTuple):
    """The graph runner (``None``: eager decode) and the summary line that says why or how many."""

    runner: CUDAGraphRunner | None
    summary: str


def capture_decode_graphs(
    model: nn.Module,
    backend: AttentionBackend,
    backend_name: str,
    kv_caches: list[KVCache],
    *,
    enabled: bool,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    sink_block: int,
    device: torch.device,
    state_caches: list | None = None,
    spare_state_slot: int = 0,
) -> CapturedGraphs:
    """Capture the decode graphs when on CUDA, ``enabled`` (``--enable-cuda-graphs``) and the backend
    allows it; ``sink_block`` is the KV block reserved for padding rows (one past the allocated ones),
    ``spare_state_slot`` a hybrid model's state row for them."""
    if device.type != "cuda" or not enabled:
        return CapturedGraphs(None, "off")
    if not backend.supports_cuda_graphs:
        return CapturedGraphs(None, f"off (attention backend {backend_name} cannot be graphed)")
    graphs = CUDAGraphRunner(
        model,
        backend,
        kv_caches,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        block_size=block_size,
        sink_block=sink_block,
        device=device,
        state_caches=state_caches,
        spare_state_slot=spare_state_slot,
    )
    seconds, memory = graphs.capture()
    summary = f"{len(graphs.buckets)} decode graphs (batch 1..{graphs.buckets[-1]}) in {seconds:.1f} s, {memory / 2**20:.0f} MiB"
    log.info("CUDA graphs: %s", summary)
    return CapturedGraphs(graphs, summary)
