"""Entry point of the ``gptq`` plugin: three quantization methods and ``fw quantize`` (no torch import)."""

from framework import hookimpl
from framework.specs import QuantMethodSpec


@hookimpl
def register_quantization_methods():
    return [
        QuantMethodSpec(name="gptq", impl="fw_gptq.config:GPTQConfig",
                        description="GPTQ 4/8-bit (gptq, gptq_v2, Marlin format; act-order) on the W4A16/W8A16 Triton core",
                        isq_types=("int4", "int8")),
        QuantMethodSpec(name="awq", impl="fw_gptq.config:AWQConfig",
                        description="AWQ GEMM 4-bit with zero points on the W4A16 Triton core"),
        QuantMethodSpec(name="compressed-tensors", impl="fw_gptq.config:CompressedTensorsConfig",
                        description="compressed-tensors pack-quantized W4A16/W8A16 (group, channel; sym, asym)"),
    ]


@hookimpl
def register_commands(app):
    from fw_gptq.quantize.cli import quantize

    app.command("quantize", help="Quantize a bf16/fp16 model to GPTQ, AWQ or RTN (compressed-tensors) 4/8-bit, or with --isq TYPE (q4k ...) to a GGUF file.")(quantize)
