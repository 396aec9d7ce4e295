"""How many KV-cache blocks an engine gets, and their allocation.

The budget is, in order of precedence: ``num_blocks`` exactly, ``--mem`` MB,
``--gpu-memory-utilization`` (vLLM's: a fraction of the GPU's *total* memory for the whole engine,
the KV cache taking what the weights and everything else already on the device leave of it), or
``--kv-fraction`` of the memory free now (after the weights). No cache grows past what
``max_num_seqs`` requests of ``max_model_len`` tokens can use, and every tensor-parallel rank takes
the smallest count any rank can hold.
"""

from __future__ import annotations

import logging
import os

import torch

from framework import distributed
from framework.attention_backend import AttentionBackend, AttentionLayerConfig
from framework.config import CacheConfig
from framework.errors import ConfigError

log = logging.getLogger("fw.engine")

#: Without --mem, a CPU KV cache takes at most this much (kv_fraction of free RAM is too greedy
#: on a shared machine, and CPU decoding is compute-bound long before it needs more).
CPU_DEFAULT_KV_BYTES = 2 << 30


def kv_budget_bytes(cache: CacheConfig, device: torch.device) -> int:
    """The bytes the KV cache may take on ``device`` (``num_blocks`` aside)."""
    if cache.mem_mb:
        return cache.mem_mb << 20
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if cache.gpu_memory_utilization is None:
            return int(free * cache.kv_fraction)
        used = total - free
        budget = int(total * cache.gpu_memory_utilization) - used
        if budget <= 0:
            raise ConfigError(
                f"--gpu-memory-utilization {cache.gpu_memory_utilization} leaves no room for the KV "
                f"cache: {used / 2**30:.1f} of the GPU's {total / 2**30:.1f} GiB are in use already "
                "(the weights and other processes); raise it, or give --mem MB"
            )
        return budget
    return min(int(available_ram() * cache.kv_fraction), CPU_DEFAULT_KV_BYTES)


def num_kv_blocks(
    cache: CacheConfig, device: torch.device, bytes_per_block: int, max_model_len: int, max_num_seqs: int
) -> int:
    """Blocks that fit the budget (see the module docstring); at least one."""
    if cache.num_blocks:
        return cache.num_blocks
    budget = kv_budget_bytes(cache, device)
    most_useful = -(-max_model_len // cache.block_size) * max_num_seqs
    # every rank holds the same blocks (of its own heads): the tightest device decides
    return distributed.min_over_ranks(max(1, min(budget // bytes_per_block, most_useful)))


def bytes_per_block(layers: list[AttentionLayerConfig], block_size: int, dtype: torch.dtype) -> int:
    """KV bytes one block takes over all ``layers`` (standard: K and V per KV head; mla: one latent
    vector per token, as ``kv_elements_per_token`` says)."""
    element = torch.empty((), dtype=dtype).element_size()
    return sum(block_size * layer.kv_elements_per_token * element for layer in layers)


def allocate_kv_caches(
    backend: AttentionBackend,
    layers: list[AttentionLayerConfig],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One zeroed cache per layer in the backend's shape, with one extra block at the end: the sink
    that CUDA-graph padding rows write into."""
    return [
        torch.zeros(backend.layer_kv_cache_shape(layer, num_blocks + 1, block_size), dtype=dtype, device=device)
        for layer in layers
    ]


def available_ram() -> int:
    """Bytes of RAM available to a new allocation (``MemAvailable``)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
