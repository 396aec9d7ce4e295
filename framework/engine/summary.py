"""The summary of a built engine: what ``Ready`` reports, ``fw bench`` prints and the log shows."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from framework import plugins

if TYPE_CHECKING:
    from framework.engine.builder import EngineBuilder
    from framework.engine.engine import EngineCore

log = logging.getLogger("fw.engine")


def engine_summary(builder: EngineBuilder, core: EngineCore) -> dict[str, Any]:
    """The model, device, KV cache, backends and sizes of the engine ``builder`` just built."""
    self, cache = builder, builder.cache
    summary = {
        "model": self.config.source,
        "architecture": self.config.architecture,
        "dtype": str(self.config.dtype).removeprefix("torch."),
        "device": str(self.device),
        "max_model_len": self.config.max_model_len,
        "kv_blocks": self.num_blocks,
        "kv_tokens": self.num_blocks * cache.block_size,
        "kv_bytes": self.kv_cache_bytes,
        "kv_cache_dtype": kv_cache_dtype_summary(builder.kv_dtype.name, cache.cache_dtype),
        "kv_bytes_per_token": self.kv_cache_bytes // max(1, self.num_blocks * cache.block_size),
        "attention_backend": self.backend_name,
        "cuda_graphs": self.graph_summary,
        "async_scheduling": core.async_scheduling,
        "weight_format": self.source.name,
        "weight_bytes": model_bytes(self.torch_model),
        "checkpoint_bytes": self.source.checkpoint_bytes(),
        "load_s": round(getattr(self, "load_seconds", 0.0), 3),
        "plugins": [info.name for info in plugins.loaded_plugins()],
        "tensor_parallel_size": self.parallel.tensor_parallel_size,
    }
    if getattr(self, "state_specs", None):  # a hybrid model's per-sequence state cache
        summary["state_slots"] = self.num_state_slots
        summary["state_bytes"] = self.state_cache_bytes
    if self.vision is not None:  # a vision model: how it takes images
        summary["vision"] = {
            "image_processor": self.vision.processor.rpartition(":")[2],
            "image_token_id": self.vision.image_token_id,
            "max_images": self.vision.max_images,
        }
    elif (reason := self.source.text_only_reason()) is not None:  # a vision family's model served as text
        summary["text_only_reason"] = reason
    if getattr(self, "isq_report", None) is not None:
        summary["isq"] = self.isq_report.describe()
    if self.parallel.is_parallel:
        summary["device"] = (
            f"{self.device} + {self.parallel.tensor_parallel_size - 1} more rank(s) "
            f"(tensor parallel {self.parallel.tensor_parallel_size}, {self.parallel.num_nodes} node(s))"
        )
        summary["all_reduce"] = self.all_reduce
    return summary


def kv_cache_dtype_summary(used: str, asked: str) -> str:
    """The KV dtype in use, with why it differs from the one asked for (MLA keeps its latent cache)."""
    if used != asked:
        return f"{used} (MLA latent cache; --kv-cache-dtype {asked} not applied)"
    return used


def log_summary(builder: EngineBuilder, summary: dict[str, Any]) -> None:
    """Log the KV cache and weight sizes of the summary."""
    cache = builder.cache
    log.info(
        "KV cache: %s, %d blocks x %d tokens = %d tokens, %.1f MiB, %d bytes per token",
        summary["kv_cache_dtype"],
        builder.num_blocks,
        cache.block_size,
        builder.num_blocks * cache.block_size,
        builder.kv_cache_bytes / 2**20,
        summary["kv_bytes_per_token"],
    )
    checkpoint = summary["checkpoint_bytes"]
    log.info(
        "Weights: %.2f GiB on %s%s, loaded in %.1f s",
        summary["weight_bytes"] / 2**30,
        builder.device,
        f" (checkpoint files {checkpoint / 2**30:.2f} GiB)" if checkpoint else "",
        summary["load_s"],
    )


def model_bytes(model: torch.nn.Module) -> int:
    """Device bytes of ``model``'s parameters and buffers (each shared tensor once): the memory its
    weights take on this rank, packed quantized weights at their packed size."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())
