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


@hookimpl
def register_model_architectures():
    return [
        ModelSpec(name=name, impl="fw_llama.model:LlamaForCausalLM", description=description, supports_tensor_parallel=True)
        for name, description in ARCHITECTURES.items()
    ]
