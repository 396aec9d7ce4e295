"""Entry point of the ``fp4`` plugin: the MXFP4 and NVFP4 methods and the MoE kernel (no torch import)."""

from framework import hookimpl
from framework.specs import KernelSpec, QuantMethodSpec


@hookimpl
def register_quantization_methods():
    return [
        QuantMethodSpec(
            name="mxfp4",
            impl="fw_fp4.config:Mxfp4Config",
            description="MXFP4 experts (gpt-oss *_blocks / *_scales: e2m1, e8m0 per 32) as W4A16",
        ),
        QuantMethodSpec(
            name="modelopt-nvfp4",
            impl="fw_fp4.nvfp4:ModelOptNvfp4Config",
            description="modelopt NVFP4 dense layers (e2m1, e4m3 per 16, fp32 weight_scale_2) as W4A16",
        ),
        QuantMethodSpec(
            name="compressed-tensors-nvfp4",
            impl="fw_fp4.nvfp4:CompressedTensorsNvfp4Config",
            description="compressed-tensors nvfp4-pack-quantized dense layers (global scale divides) as W4A16",
        ),
        QuantMethodSpec(
            name="compressed-tensors-mxfp4",
            impl="fw_fp4.mxfp4_linear:CompressedTensorsMxfp4Config",
            description="compressed-tensors mxfp4-pack-quantized dense layers (e2m1, e8m0 per 32) as W4A16",
        ),
    ]


@hookimpl
def resolve_quantization_method(quantization_config, requested):
    """FP4 checkpoints are this plugin's: compressed-tensors ``nvfp4-pack-quantized`` and
    ``mxfp4-pack-quantized`` (fw-gptq's ``compressed-tensors`` serves the integer formats) and
    modelopt ``quant_algo: NVFP4``."""
    config = quantization_config or {}
    if requested:
        return None
    if config.get("quant_method") == "compressed-tensors" and config.get("format") == "nvfp4-pack-quantized":
        return "compressed-tensors-nvfp4"
    if config.get("quant_method") == "compressed-tensors" and config.get("format") == "mxfp4-pack-quantized":
        return "compressed-tensors-mxfp4"
    if config.get("quant_method") == "modelopt" and config.get("quant_algo") == "NVFP4":
        return "modelopt-nvfp4"
    return None


@hookimpl
def register_kernels():
    return [
        KernelSpec(
            op="quantized_fused_moe",
            name="triton_fp4",
            impl="fw_fp4.kernels.fp4_moe:quantized_fused_moe",
            description="MXFP4 and NVFP4 experts as two grouped GEMMs, FP4 decoded by bit manipulation; other types: reference",
            priority=10,
            devices=("cuda",),
            requires=("triton",),
        )
    ]
