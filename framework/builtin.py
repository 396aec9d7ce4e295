"""fw's own features, registered as the built-in plugin ``core`` (as datasette does).

The defaults of ``firstresult`` hooks are ``trylast`` so any installed plugin overrides them.
"""

from __future__ import annotations

from typing import Any

from framework import hookimpl
from framework.specs import KernelSpec, KVCacheDtypeSpec, WeightFormatSpec

#: The torch reference implementation of every op: runs anywhere and is the test oracle.
REFERENCE_KERNELS = {
    "rms_norm": "framework.ops:rms_norm",
    "fused_add_rms_norm": "framework.ops:fused_add_rms_norm",
    "silu_and_mul": "framework.ops:silu_and_mul",
    "gelu_tanh_and_mul": "framework.ops:gelu_tanh_and_mul",
    "rotary_embedding": "framework.ops:rotary_embedding",
    "qk_norm_rotary_embedding": "framework.ops:qk_norm_rotary_embedding",
    "fused_moe": "framework.ops:fused_moe",
    "quantized_fused_moe": "framework.ops:quantized_fused_moe",
    "linear": "framework.ops:linear",
}


@hookimpl
def register_weight_formats() -> list[WeightFormatSpec]:
    return [
        WeightFormatSpec(
            name="safetensors",
            impl="framework.loader.safetensors_format:SafetensorsFormat",
            description="Hugging Face checkpoints: config.json + *.safetensors (sharded, mmap)",
        ),
        WeightFormatSpec(
            name="dummy",
            impl="framework.loader.dummy_format:DummyFormat",
            description="random weights for a config.json (benchmarks of large shapes); only by name",
            priority=-100,
        ),
    ]


@hookimpl
def register_kernels() -> list[KernelSpec]:
    return [
        KernelSpec(op=op, name="torch", impl=impl, description="torch reference")
        for op, impl in REFERENCE_KERNELS.items()
    ]


@hookimpl
def register_kv_cache_dtypes() -> list[KVCacheDtypeSpec]:
    return [KVCacheDtypeSpec(name="auto", bits=16, description="the model's dtype", backends=())]


@hookimpl(trylast=True)
def select_attention_backend(candidates: list[Any], requested: str | None) -> str | None:
    names = [spec.name for spec in candidates]
    if requested and requested != "auto" and requested in names:
        return requested
    return names[0] if names else None


@hookimpl(trylast=True)
def resolve_quantization_method(quantization_config: dict | None, requested: str | None) -> str | None:
    if requested:
        return requested
    if quantization_config:
        return quantization_config.get("quant_method")
    return None


@hookimpl(trylast=True)
def default_parsers() -> dict:
    return {"tool": None, "reasoning": None}
