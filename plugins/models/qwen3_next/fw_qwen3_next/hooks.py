"""Entry point of the ``qwen3_next`` plugin: which architecture names it serves (no torch import)."""

from framework import hookimpl
from framework.specs import ModelSpec

#: HF ``architectures`` names served by the one hybrid implementation (``model.py``).
ARCHITECTURES = {
    "Qwen3NextForCausalLM": "Qwen3-Next (e.g. 80B-A3B): Gated DeltaNet and gated attention 3:1, "
    "MoE with a gated shared expert",
    "Qwen3_5ForCausalLM": "Qwen3.5 dense text: Gated DeltaNet and gated attention 3:1",
    "Qwen3_5MoeForCausalLM": "Qwen3.5 MoE text (e.g. 35B-A3B): Qwen3.5 layers, MoE with a gated shared expert",
}

#: the Hub's Qwen3.5 checkpoints: the hybrid language model and Qwen3-VL's tower without DeepStack
#: (``qwen3_5_vl.py``, built on fw-llama's Qwen-VL pieces)
VISION_ARCHITECTURES = {
    "Qwen3_5ForConditionalGeneration": "Qwen3.5 dense checkpoints (e.g. 27B): image input (Qwen3-VL's tower "
    "without DeepStack, interleaved M-RoPE on the attention layers; no video yet); images need one device",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3.5 MoE checkpoints (e.g. 35B-A3B): image input as the dense "
    "ones; images need one device",
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
    ] + [
        ModelSpec(
            name=name,
            impl="fw_qwen3_next.qwen3_5_vl:Qwen3_5ForConditionalGeneration",
            description=description,
            supports_tensor_parallel=True,  # text prompts; the engine refuses images under tensor parallelism
        )
        for name, description in VISION_ARCHITECTURES.items()
    ]
