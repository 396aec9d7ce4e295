"""Which attention backend an engine runs: every registered backend that can run the model here,
then the ``select_attention_backend`` hook's pick among them (a requested one that cannot run
says why)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from framework import plugins, registries
from framework.attention_backend import AttentionLayerConfig
from framework.config import ModelConfig
from framework.errors import ConfigError
from framework.platform import Platform

log = logging.getLogger("fw.engine")


def refusal_reasons(
    spec: Any,
    layers: list[AttentionLayerConfig],
    layout: str,
    cache_dtype: str,
    model_dtype: torch.dtype,
    platform: Platform,
) -> list[str]:
    """Why backend ``spec`` cannot run these layers here (empty: it can)."""
    reasons = spec.unavailable_reasons(platform)
    if layout not in spec.kv_cache_layouts:
        reasons.append(f"KV layout {layout!r} unsupported (it reads: {', '.join(spec.kv_cache_layouts)})")
    if cache_dtype not in spec.kv_cache_dtypes:
        reasons.append(f"kv dtype {cache_dtype} unsupported")
    dtype_name = str(model_dtype).removeprefix("torch.")
    if spec.model_dtypes and dtype_name not in spec.model_dtypes:
        reasons.append(f"model dtype {dtype_name} unsupported (supports {', '.join(spec.model_dtypes)})")
    if not reasons:
        backend_cls = spec.load()
        if any(layer.has_sinks for layer in layers) and not backend_cls.supports_sinks:
            reasons.append("attention sinks (gpt-oss) unsupported")
        if any(layer.attention_chunk_size for layer in layers) and not backend_cls.supports_chunked_attention:
            reasons.append("chunked local attention (Llama 4 attention_chunk_size) unsupported")
        if (
            any(layer.mla is not None and layer.mla.is_sparse for layer in layers)
            and not backend_cls.supports_sparse_mla
        ):
            reasons.append("DeepSeek sparse attention (MLA with a lightning indexer's top-k) unsupported")
        if any(layer.has_bidirectional_spans for layer in layers) and not backend_cls.supports_bidirectional_spans:
            reasons.append("bidirectional attention over an image's tokens (Gemma 3 vision) unsupported")
        reasons += backend_cls.validate(layers, cache_dtype, platform)
    return reasons


def choose_attention_backend(
    layers: list[AttentionLayerConfig], config: ModelConfig, cache_dtype: str, requested: str | None, platform: Platform
) -> str:
    """The name of the backend to run ``layers`` with; :class:`ConfigError` when none (or the
    requested one) can run, with every refused backend's reasons."""
    registry = registries.attention_backends(platform)
    layout = registries.model_architectures(platform).get(config.architecture).kv_cache_layout
    mismatched = sorted({layer.kv_cache_layout for layer in layers} - {layout})
    if mismatched:
        raise ConfigError(
            f"{config.architecture} registers KV layout {layout!r} but its attention layers "
            f"use {', '.join(map(repr, mismatched))}: fix the plugin's ModelSpec.kv_cache_layout"
        )
    refusals: dict[str, list[str]] = {}
    candidates = []
    for spec in registry:
        reasons = refusal_reasons(spec, layers, layout, cache_dtype, config.dtype, platform)
        if reasons:
            refusals[spec.name] = reasons
        else:
            candidates.append(spec)
    if requested not in (None, "auto"):
        registry.get(requested)  # unknown names list the valid ones
        if requested in refusals:
            raise ConfigError(f"attention backend {requested!r} cannot run: {'; '.join(refusals[requested])}")
    if not candidates:
        detail = "; ".join(f"{name}: {', '.join(why)}" for name, why in refusals.items())
        raise ConfigError(f"no attention backend can run this model here ({detail})")
    name = plugins.call_first(
        "select_attention_backend", candidates=candidates, requested=requested, model_config=config, platform=platform
    )
    for refused, why in refusals.items():
        log.info("attention backend %s not used: %s", refused, "; ".join(why))
    return name
