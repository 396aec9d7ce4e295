"""Entry point of the ``deepseek`` plugin: which architecture names it serves (no torch import)."""

from framework import hookimpl
from framework.specs import ModelSpec


@hookimpl
def register_model_architectures():
    return [
        ModelSpec(
            name="DeepseekV2ForCausalLM",
            impl="fw_deepseek.model:DeepseekV2ForCausalLM",
            description="DeepSeek-V2 / V2-Lite: multi-head latent attention (compressed 'mla' KV cache), DeepSeek MoE; "
            "tensor parallel: MLPs, experts and attention heads split, the latent cache replicated",
            kv_cache_layout="mla",
            supports_tensor_parallel=True,
        )
    ]
