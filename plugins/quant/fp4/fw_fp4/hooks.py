"""Entry point of the ``fp4`` plugin: the ``mxfp4`` method and its MoE kernel (no torch import)."""

from framework import hookimpl
from framework.specs import KernelSpec, QuantMethodSpec


@hookimpl
def register_quantization_methods():
    return [
        QuantMethodSpec(
            name="mxfp4",
            impl="fw_fp4.config:Mxfp4Config",
            description="MXFP4 experts (gpt-oss *_blocks / *_scales: e2m1, e8m0 per 32) as W4A16",
        )
    ]


@hookimpl
def register_kernels():
    return [
        KernelSpec(
            op="quantized_fused_moe",
            name="triton_mxfp4",
            impl="fw_fp4.kernels.mxfp4_moe:quantized_fused_moe",
            description="MXFP4 experts as two grouped GEMMs, FP4 decoded by bit manipulation; other types: reference",
            priority=10,
            devices=("cuda",),
            requires=("triton",),
        )
    ]
