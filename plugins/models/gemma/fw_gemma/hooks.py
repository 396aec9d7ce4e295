"""Entry point of the ``gemma`` plugin: which architecture names it serves (no torch import)."""

from framework import hookimpl
from framework.specs import ModelSpec

#: HF ``architectures`` names served by the one Gemma implementation.
ARCHITECTURES = {
    "GemmaForCausalLM": "Gemma (1): GeGLU, (1 + w) RMSNorm, scaled embeddings",
    "Gemma2ForCausalLM": "Gemma 2: four norms per layer, alternating sliding window, soft-capped logits",
    "Gemma3ForCausalLM": "Gemma 3 text: 5 local : 1 global layers, QK norm, local and global RoPE bases",
}


@hookimpl
def register_model_architectures():
    return [
        ModelSpec(
            name=name, impl="fw_gemma.model:GemmaForCausalLM", description=description, supports_tensor_parallel=True
        )
        for name, description in ARCHITECTURES.items()
    ]
