"""Entry point of the ``deepseek`` plugin: which architecture names it serves (no torch import)."""

from framework import hookimpl
from framework.specs import ModelSpec

_TENSOR_PARALLEL = "tensor parallel: MLPs, experts and attention heads split, the latent cache replicated"

#: HF ``architectures[0]`` -> (implementation, description); all run MLA over the "mla" KV layout.
ARCHITECTURES = {
    "DeepseekV2ForCausalLM": (
        "fw_deepseek.model:DeepseekV2ForCausalLM",
        "DeepSeek-V2 / V2-Lite: multi-head latent attention (compressed 'mla' KV cache), DeepSeek MoE",
    ),
    "DeepseekV3ForCausalLM": (
        "fw_deepseek.v3:DeepseekV3ForCausalLM",
        "DeepSeek-V3 / R1: MLA, sigmoid router with score-correction bias and group-limited top-k, "
        "shared experts; the MTP layer is skipped",
    ),
    "Glm4MoeLiteForCausalLM": (
        "fw_deepseek.v3:Glm4MoeLiteForCausalLM",
        "GLM-4.7-Flash: MLA with DeepSeek-V3's MoE (sparse layers per mlp_layer_types); the MTP layer is skipped",
    ),
    "DeepseekV32ForCausalLM": (
        "fw_deepseek.dsa:DeepseekV32ForCausalLM",
        "DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention (a lightning indexer picks each query's "
        "index_topk tokens; torch attention backend only); the MTP layer is skipped",
    ),
    "GlmMoeDsaForCausalLM": (
        "fw_deepseek.dsa:GlmMoeDsaForCausalLM",
        "GLM-5: DeepSeek-V3.2's sparse attention (interleaved indexer rotary, layers sharing an indexer's "
        "choice per indexer_types; torch attention backend only); the MTP layer is skipped",
    ),
}


@hookimpl
def register_model_architectures():
    return [
        ModelSpec(
            name=name,
            impl=impl,
            description=f"{description}; {_TENSOR_PARALLEL}",
            kv_cache_layout="mla",
            supports_tensor_parallel=True,
        )
        for name, (impl, description) in ARCHITECTURES.items()
    ]
