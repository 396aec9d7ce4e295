"""Entry point of the ``gptq`` plugin: three quantization methods, their MoE kernel and ``fw quantize``
(no torch import)."""

from framework import hookimpl
from framework.specs import KernelSpec, QuantMethodSpec


@hookimpl
def register_quantization_methods():
    return [
        QuantMethodSpec(
            name="gptq",
            impl="fw_gptq.config:GPTQConfig",
            description="GPTQ 4/8-bit (gptq, gptq_v2, Marlin format; act-order) on the W4A16/W8A16 Triton core",
            isq_types=("int4", "int8"),
        ),
        QuantMethodSpec(
            name="awq",
            impl="fw_gptq.config:AWQConfig",
            description="AWQ GEMM 4-bit with zero points on the W4A16 Triton core",
        ),
        QuantMethodSpec(
            name="compressed-tensors",
            impl="fw_gptq.config:CompressedTensorsConfig",
            description="compressed-tensors pack-quantized W4A16/W8A16 (group, channel; sym, asym)",
        ),
    ]


@hookimpl
def register_kernels():
    """The wna16 expert stacks' ``quantized_fused_moe``. Below fw-fp4's MXFP4 kernel (priority 10) and
    fw-gguf's (5), so the default choice for other formats is unchanged: the MoE method asks for this
    one by name (``get_kernel(..., prefer="triton_wna16")``); other types go to the torch reference."""
    return [
        KernelSpec(
            op="quantized_fused_moe",
            name="triton_wna16",
            impl="fw_gptq.kernels.moe:quantized_fused_moe",
            description="GPTQ/AWQ/compressed-tensors 4/8-bit experts as two grouped Triton GEMMs; "
            "other types: reference",
            priority=4,
            devices=("cuda",),
            requires=("triton",),
        ),
    ]


@hookimpl
def register_commands(app):
    from fw_gptq.quantize.cli import quantize

    app.command(
        "quantize",
        help="Quantize a bf16/fp16 model to GPTQ, AWQ or RTN (compressed-tensors) 4/8-bit, or with --isq TYPE (q4k ...) to a GGUF file.",
    )(quantize)
