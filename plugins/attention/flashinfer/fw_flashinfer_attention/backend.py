"""The FlashInfer attention backend: plan once per step on the host, run per layer on the device.

Per step, ``prepare`` turns the block tables into FlashInfer's paged-KV description and plans one
wrapper per distinct layer configuration (Gemma's sliding and global layers need two):

- prefill and mixed steps: ``BatchPrefillWithPagedKVCacheWrapper`` (causal, the query aligned to
  the end of each sequence, so a cached prefix is attended to);
- decode-only steps: ``BatchDecodeWithPagedKVCacheWrapper``; a step that captures or replays the
  decode CUDA graph of ``B`` rows uses wrappers created for that ``B`` with static index buffers
  (``use_cuda_graph=True``), planned outside the graph before every replay.

``forward`` stores the new K/V by slot into fw's standard NHD cache ``[2, blocks, block_size,
kv_heads, head_size]`` and runs the planned wrapper on ``(cache[0], cache[1])``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from framework.attention_backend import AttentionBackend, AttentionLayerConfig, AttentionMetadata
from framework.kv_cache import KVCache
from fw_flashinfer_attention.paging import paged_kv_from_block_table

#: Head sizes FlashInfer's prebuilt and JIT templates are known to handle.
HEAD_SIZES = (64, 128, 256)
#: The float workspace shared by every wrapper (split-KV partial results); FlashInfer suggests 128 MB.
WORKSPACE_BYTES = 256 << 20


def use_tensor_cores(layer: AttentionLayerConfig) -> bool:
    """Decode on tensor cores (the prefill kernels) when queries per KV head make it pay off.

    ``FW_FLASHINFER_DECODE_TENSOR_CORES=0/1`` forces it either way."""
    forced = os.environ.get("FW_FLASHINFER_DECODE_TENSOR_CORES")
    if forced is not None:
        return forced == "1"
    return layer.num_heads // layer.num_kv_heads >= 4


class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention through FlashInfer; standard NHD cache, cache dtype = model dtype (fp16/bf16)."""

    name = "flashinfer"
    supports_cuda_graphs = True  # decode runs on static buffers planned before each replay

    def __init__(self) -> None:
        self.layers: list[AttentionLayerConfig] = []
        self.dtype: torch.dtype | None = None
        self.block_size = 0
        self.device: torch.device | None = None
        self.workspace: torch.Tensor | None = None
        self.prefill_wrappers: dict[AttentionLayerConfig, Any] = {}
        self.decode_wrappers: dict[AttentionLayerConfig, Any] = {}
        self.graph_wrappers: dict[tuple[int, AttentionLayerConfig], Any] = {}
        self.planned: dict[AttentionLayerConfig, Any] = {}
        self.plan_copied: torch.cuda.Event | None = None  # recorded after the latest plan's copies

    @classmethod
    def validate(cls, layer_configs: list[AttentionLayerConfig], kv_cache_dtype: str, platform: Any) -> list[str]:
        reasons: list[str] = []
        if kv_cache_dtype != "auto":
            reasons.append(f"kv dtype {kv_cache_dtype} unsupported (only 'auto')")
        for num_heads, num_kv_heads, head_size in {(c.num_heads, c.num_kv_heads, c.head_size) for c in layer_configs}:
            if head_size not in HEAD_SIZES:
                reasons.append(f"head size {head_size} unsupported (supports {', '.join(map(str, HEAD_SIZES))})")
            if num_kv_heads < 1 or num_heads % num_kv_heads:
                reasons.append(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        return reasons

    def initialize(
        self, layers: list[AttentionLayerConfig], dtype: torch.dtype, block_size: int, device: torch.device
    ) -> None:
        self.layers = list(dict.fromkeys(layers))  # distinct configurations, in order
        self.dtype, self.block_size, self.device = dtype, block_size, device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)

    # -- planning (host side, outside CUDA graphs) -------------------------------------------------

    def prepare(self, metadata: AttentionMetadata) -> None:
        table = metadata.host_block_table()
        paged = paged_kv_from_block_table(metadata.seq_lens_cpu, table, self.block_size)
        if self.plan_copied is not None:
            # A plan writes a pinned host buffer and queues its copy to the device. With async
            # scheduling this plan runs while the previous step is queued: wait until that step's
            # copy has run (the engine has already waited for the step before it, so this is short).
            self.plan_copied.synchronize()
        self.planned = {}
        for layer in self.layers:
            common = dict(
                window_left=-1 if layer.sliding_window is None else layer.sliding_window - 1,
                logits_soft_cap=layer.logits_soft_cap,
                sm_scale=layer.scale,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
            )
            if metadata.is_decode_only:
                wrapper = self._decode_wrapper(layer, metadata.graph_batch_size, metadata.max_seq_len)
                wrapper.plan(
                    paged.indptr,
                    paged.indices,
                    paged.last_page_len,
                    layer.num_heads,
                    layer.num_kv_heads,
                    layer.head_size,
                    self.block_size,
                    **common,
                )
            else:
                wrapper = self._prefill_wrapper(layer)
                wrapper.plan(
                    metadata.cu_seqlens_q_cpu.to(torch.int32),
                    paged.indptr,
                    paged.indices,
                    paged.last_page_len,
                    layer.num_heads,
                    layer.num_kv_heads,
                    layer.head_size,
                    self.block_size,
                    causal=True,
                    **common,
                )
            self.planned[layer] = wrapper
        if self.device.type == "cuda":
            self.plan_copied = torch.cuda.Event()
            self.plan_copied.record()

    def _prefill_wrapper(self, layer: AttentionLayerConfig) -> Any:
        import flashinfer

        if layer not in self.prefill_wrappers:
            self.prefill_wrappers[layer] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        return self.prefill_wrappers[layer]

    def _decode_wrapper(self, layer: AttentionLayerConfig, graph_batch_size: int | None, max_seq_len: int) -> Any:
        import flashinfer

        tensor_cores = use_tensor_cores(layer)
        if graph_batch_size is None:
            if layer not in self.decode_wrappers:
                self.decode_wrappers[layer] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=tensor_cores
                )
            return self.decode_wrappers[layer]
        key = (graph_batch_size, layer)
        if key not in self.graph_wrappers:
            max_pages = graph_batch_size * -(-max_seq_len // self.block_size)
            buffers = dict(device=self.device, dtype=torch.int32)
            self.graph_wrappers[key] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(graph_batch_size + 1, **buffers),
                paged_kv_indices_buffer=torch.zeros(max_pages, **buffers),
                paged_kv_last_page_len_buffer=torch.zeros(graph_batch_size, **buffers),
            )
        return self.graph_wrappers[key]

    # -- the per-layer call (device side, graph-safe) ----------------------------------------------

    def forward(
        self,
        layer: AttentionLayerConfig,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        key_cache, value_cache = kv_cache.data[0], kv_cache.data[1]
        slots = metadata.slot_mapping
        key_cache.view(-1, layer.num_kv_heads, layer.head_size).index_copy_(
            0, slots, key.view(num_tokens, layer.num_kv_heads, layer.head_size)
        )
        value_cache.view(-1, layer.num_kv_heads, layer.head_size).index_copy_(
            0, slots, value.view(num_tokens, layer.num_kv_heads, layer.head_size)
        )
        wrapper = self.planned.get(layer)
        if wrapper is None:
            raise RuntimeError(f"FlashInfer backend: no plan for layer {layer}; prepare() must run before forward()")
        output = wrapper.run(query.view(num_tokens, layer.num_heads, layer.head_size), (key_cache, value_cache))
        return output.view(num_tokens, layer.num_heads * layer.head_size)
