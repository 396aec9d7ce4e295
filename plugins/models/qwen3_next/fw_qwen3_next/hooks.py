"""Entry point of the ``qwen3_next`` plugin: which architecture names it serves (no torch import)."""

from framework import hookimpl
from framework.specs import ModelSpec

#: HF ``architectures`` names served by the one hybrid implementation (``model.py``).
ARCHITECTURES = {
    "Qwen3NextForCausalLM": "Qwen3-Next (e.g. 80B-A3B): Gated DeltaNet and gated attention 3:1, "
    "MoE with a gated shared expert",
    "Qwen3_5ForCausalLM": "Qwen3.5 dense text: Gated DeltaNet and gated attention 3:1",
    "Qwen3_5MoeForCausalLM": "Qwen3.5 MoE text (e.g. 35B-A3B): Qwen3.5 layers, MoE with a gated shared expert",
    # the Hub's Qwen3.5 checkpoints: the language model under model.language_model, the vision tower unused
    "Qwen3_5ForConditionalGeneration": "Qwen3.5 dense checkpoints (e.g. 27B): the text model; images are not supported",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3.5 MoE checkpoints (e.g. 35B-A3B): the text model; images are not supported",
}


@hookimpl
def register_model_architectures():
    return [
        ModelSpec(
            name=name,
            impl="fw_qwen3_next.model:Qwen3NextForCausalLM",
            description=description,
            supports_tensor_parallel=True,
        )
        for name, description in ARCHITECTURES.items()
    ]
