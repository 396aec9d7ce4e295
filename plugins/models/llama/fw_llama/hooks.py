"""Entry point of the ``llama`` plugin: which architecture names it serves (no torch import)."""

from framework import hookimpl
from framework.specs import ModelSpec

#: HF ``architectures`` names served by the one Llama implementation.
ARCHITECTURES = {
    "LlamaForCausalLM": "Llama 2/3, SmolLM, Yi, and most Llama derivatives",
    "MistralForCausalLM": "Mistral (sliding-window attention)",
    "Qwen2ForCausalLM": "Qwen2 / Qwen2.5 (bias on q/k/v)",
    "YiForCausalLM": "Yi (Llama architecture under its own name)",
}

#: Mixture-of-experts members (Llama attention, FusedMoE feed-forward); not sharded for TP yet.
MOE_ARCHITECTURES = {
    "MixtralForCausalLM": "Mixtral 8x7B / 8x22B (softmax top-2 experts)",
    "Qwen2MoeForCausalLM": "Qwen1.5-MoE / Qwen2-MoE (routed experts + gated shared expert, q/k/v bias)",
    "Qwen3MoeForCausalLM": "Qwen3-MoE, e.g. Qwen3-30B-A3B (128 experts, top-8, QK norm)",
}


@hookimpl
def register_model_architectures():
    return [
        ModelSpec(name=name, impl="fw_llama.model:LlamaForCausalLM", description=description, supports_tensor_parallel=True)
        for name, description in ARCHITECTURES.items()
    ] + [
        ModelSpec(name=name, impl="fw_llama.moe:LlamaMoeForCausalLM", description=description, supports_tensor_parallel=False)
        for name, description in MOE_ARCHITECTURES.items()
    ]
