"""fw's own features, registered as the built-in plugin ``core`` (as datasette does).

The defaults of ``firstresult`` hooks are ``trylast`` so any installed plugin overrides them.
"""

from __future__ import annotations

from typing import Any

from framework import hookimpl
from framework.specs import KernelSpec, KVCacheDtypeSpec, ParserSpec, WeightFormatSpec

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
    "moe_align_block_size": "framework.ops:moe_align_block_size",
    "linear": "framework.ops:linear",
    "causal_conv1d": "framework.ops_linear_attention:causal_conv1d",
    "gated_delta_rule": "framework.ops_linear_attention:gated_delta_rule",
    "gdn_gating": "framework.ops_linear_attention:gdn_gating",
    "select_experts": "framework.ops_fused:select_experts",
    "sigmoid_gate_mul": "framework.ops_fused:sigmoid_gate_mul",
    "rms_norm_gated": "framework.ops_fused:rms_norm_gated",
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
def register_tool_parsers() -> list[ParserSpec]:
    return [
        ParserSpec(
            name="generic",
            impl="framework.parsers.generic:GenericToolParser",
            kind="tool",
            description="fw's generic format for templates without tool markup: "
            '<tool_call>{"name": ..., "arguments": {...}}</tool_call>',
        )
    ]


@hookimpl
def register_kernels() -> list[KernelSpec]:
    return [
        KernelSpec(op=op, name="torch", impl=impl, description="torch reference")
        for op, impl in REFERENCE_KERNELS.items()
    ]


@hookimpl
def register_kv_cache_dtypes() -> list[KVCacheDtypeSpec]:
    readers = ("torch", "torch_sdpa", "triton")
    return [
        KVCacheDtypeSpec(name="auto", bits=16, description="the model's dtype", backends=()),
        KVCacheDtypeSpec(
            name="fp8",
            bits=8,
            description="FP8 e4m3 keys and values, absmax scale per token and head",
            backends=readers,
            key_format="fp8",
            value_format="fp8",
        ),
        KVCacheDtypeSpec(
            name="turbo8",
            bits=6,
            description="FP8 keys + 4-bit values, both rotated (TurboQuant, candle-vllm's turbo8)",
            backends=readers,
            key_format="fp8",
            value_format="int4",
            rotate_keys=True,
            rotate_values=True,
        ),
        KVCacheDtypeSpec(
            name="turbo4",
            bits=4,
            description="4-bit keys + 4-bit values, both rotated (TurboQuant)",
            backends=readers,
            key_format="int4",
            value_format="int4",
            rotate_keys=True,
            rotate_values=True,
        ),
        KVCacheDtypeSpec(
            name="turbo3",
            bits=3.5,
            description="3-bit keys + 4-bit values, both rotated (TurboQuant)",
            backends=readers,
            key_format="int3",
            value_format="int4",
            rotate_keys=True,
            rotate_values=True,
        ),
    ]


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
