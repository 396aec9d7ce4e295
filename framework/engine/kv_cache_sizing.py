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

from framework import distributed, registries
from framework.attention_backend import AttentionLayerConfig
from framework.config import CacheConfig
from framework.errors import ConfigError
from framework.kv_cache import KVCache, KVCacheSpec
from framework.platform import Platform
from framework.specs import KVCacheDtypeSpec

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
    cache: CacheConfig,
    device: torch.device,
    bytes_per_block: int,
    max_model_len: int,
    max_num_seqs: int,
    reserved_bytes: int = 0,
) -> int:
    """Blocks that fit the budget (see the module docstring) less ``reserved_bytes`` (a hybrid
    model's state cache, allocated after the blocks); at least one."""
    if cache.num_blocks:
        return cache.num_blocks
    budget = kv_budget_bytes(cache, device) - reserved_bytes
    most_useful = -(-max_model_len // cache.block_size) * max_num_seqs
    # every rank holds the same blocks (of its own heads): the tightest device decides
    return distributed.min_over_ranks(max(1, min(budget // bytes_per_block, most_useful)))


def warn_if_short(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """Log that a cache of ``num_blocks`` holds less than one request of the context length."""
    if num_blocks * block_size < max_model_len:
        log.warning(
            "KV cache holds %d tokens, less than the context length %d: long requests will be preempted "
            "or refused; raise --mem / --kv-fraction / --gpu-memory-utilization or lower --max-model-len",
            num_blocks * block_size,
            max_model_len,
        )


def bytes_per_block(specs: list[KVCacheSpec]) -> int:
    """KV bytes one block takes over all layers (each layer's spec: data plus side buffers)."""
    return sum(spec.bytes_per_block for spec in specs)


def allocate_kv_caches(specs: list[KVCacheSpec], num_blocks: int, device: torch.device) -> list[KVCache]:
    """One zeroed cache per layer as its spec says, with one extra block at the end: the sink that
    CUDA-graph padding rows write into. Rotated dtypes seed their signs with the layer index."""
    return [spec.allocate(num_blocks + 1, device, seed=index) for index, spec in enumerate(specs)]


def effective_kv_dtype(layers: list[AttentionLayerConfig], requested: str, platform: Platform) -> KVCacheDtypeSpec:
    """The registered KV dtype the cache uses: ``requested``, except that a model with MLA layers
    keeps its latent cache in the model dtype (and says so)."""
    registry = registries.kv_cache_dtypes(platform)
    if requested != "auto" and any(layer.mla is not None for layer in layers):
        log.info(
            "KV cache: this model's multi-head latent attention keeps its latent cache in the model dtype "
            "(--kv-cache-dtype %s applies to standard K/V caches)",
            requested,
        )
        requested = "auto"
    return registry.get(requested)


def load_checkpoint_scales(model: torch.nn.Module | None, caches: list[KVCache]) -> None:
    """Give each quantized cache its ``Attention`` layer's checkpoint ``k_scale`` / ``v_scale``
    (per KV head, float32) where the checkpoint had them."""
    if model is None:
        return
    from framework.layers.attention import Attention

    for module in model.modules():
        if isinstance(module, Attention) and module.layer_index < len(caches):
            cache = caches[module.layer_index]
            if cache.is_quantized:
                cache.k_scale, cache.v_scale = module.checkpoint_kv_scales(cache.data.device)


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
