"""Entry point of the ``gguf`` plugin: a weight format, a quantization method and its MoE kernel (no torch import)."""

from framework import hookimpl
from framework.specs import KernelSpec, QuantMethodSpec, WeightFormatSpec


@hookimpl
def register_weight_formats():
    return [
        WeightFormatSpec(
            name="gguf",
            impl="fw_gguf.format:GGUFFormat",
            description="llama.cpp GGUF files: one file, split shards, a directory, or --m repo --f file on the Hub",
            priority=10,
            requires=("gguf",),
        )
    ]


@hookimpl
def register_quantization_methods():
    return [
        QuantMethodSpec(
            name="gguf",
            impl="fw_gguf.method:GGUFQuantConfig",
            description="GGUF block quants F32/F16/BF16, Q4_0..Q8_0, Q2_K..Q6_K kept packed; dequantized in the matmul",
            requires=("gguf",),
            isq_types=("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2k", "q3k", "q4k", "q5k", "q6k"),
        )
    ]


@hookimpl
def register_kernels():
    """The GGUF expert stacks' ``quantized_fused_moe``. Below fw-fp4's MXFP4 kernel (priority 10),
    so the default choice for other formats is unchanged: the gguf MoE method asks for this one by
    name (``get_kernel(..., prefer="triton_gguf")``); other types go to the torch reference."""
    return [
        KernelSpec(
            op="quantized_fused_moe",
            name="triton_gguf",
            impl="fw_gguf.kernels.moe:quantized_fused_moe",
            description="GGUF experts (every type fw_gguf.kernels decodes) as two grouped GEMMs; other types: reference",
            priority=5,
            devices=("cuda",),
            requires=("triton", "gguf"),
        )
    ]
