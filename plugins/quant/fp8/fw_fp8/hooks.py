"""Entry point of the ``fp8`` plugin: the FP8 quantization methods and their MoE kernel (no torch import)."""

from framework import hookimpl
from framework.specs import KernelSpec, QuantMethodSpec


@hookimpl
def register_quantization_methods():
    return [
        QuantMethodSpec(
            name="fp8",
            impl="fw_fp8.config:Fp8Config",
            description="FP8 E4M3 weights: HF block-wise [128, 128] (Qwen3-FP8, DeepSeek) or "
            "per-tensor; --quantization fp8 quantizes a 16-bit model at load",
            isq_types=("fp8",),
        ),
        QuantMethodSpec(
            name="compressed-tensors-fp8",
            impl="fw_fp8.config:CompressedTensorsFp8Config",
            description="compressed-tensors float-quantized FP8 (tensor, channel, block; static or dynamic inputs)",
        ),
        QuantMethodSpec(
            name="fbgemm_fp8",
            impl="fw_fp8.config:FbgemmFp8Config",
            description="fbgemm FP8: per-channel weights, dynamic per-token activations",
        ),
        QuantMethodSpec(
            name="modelopt",
            impl="fw_fp8.config:ModelOptFp8Config",
            description="NVIDIA ModelOpt FP8: per-tensor weights, static input scales",
        ),
    ]


@hookimpl
def register_kernels():
    """The FP8 expert stacks' ``quantized_fused_moe``. Below fw-fp4's MXFP4 kernel (priority 10),
    fw-gguf's (5) and fw-gptq's (4), so the default choice for other formats is unchanged: the FP8 MoE
    method asks for this one by name (``get_kernel(..., prefer="triton_fp8")``); other types go to the
    torch reference."""
    return [
        KernelSpec(
            op="quantized_fused_moe",
            name="triton_fp8",
            impl="fw_fp8.kernels.moe:quantized_fused_moe",
            description="FP8 E4M3 experts (block, channel, tensor scales) as two grouped Triton GEMMs; "
            "other types: reference",
            priority=3,
            devices=("cuda",),
            requires=("triton",),
        ),
    ]


@hookimpl
def resolve_quantization_method(quantization_config, requested):
    """A compressed-tensors checkpoint with FP8 (float) weights is this plugin's, not the integer one's."""
    if requested or not quantization_config or quantization_config.get("quant_method") != "compressed-tensors":
        return None
    groups = list((quantization_config.get("config_groups") or {}).values())
    if quantization_config.get("format") == "nvfp4-pack-quantized":
        return None  # 4-bit floats: fw-fp4's
    if quantization_config.get("format") in ("float-quantized", "naive-quantized") or any(
        (g.get("weights") or {}).get("type") == "float" and (g.get("weights") or {}).get("num_bits", 8) == 8
        for g in groups
    ):
        return "compressed-tensors-fp8"
    return None
