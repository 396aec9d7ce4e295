"""Entry point of the ``llama`` plugin: which architecture names it serves (no torch import)."""

from framework import hookimpl
from framework.specs import ModelSpec

#: HF ``architectures`` names served by the one Llama implementation, with whether tensor
#: parallelism has been verified for them.
ARCHITECTURES = {
    "LlamaForCausalLM": ("Llama 2/3, SmolLM, Yi, and most Llama derivatives", True),
    "MistralForCausalLM": ("Mistral (sliding-window attention)", True),
    "Qwen2ForCausalLM": ("Qwen2 / Qwen2.5 (bias on q/k/v)", True),
    "YiForCausalLM": ("Yi (Llama architecture under its own name)", True),
    "Qwen3ForCausalLM": ("Qwen3 dense (RMSNorm per head on q and k)", True),
    "Phi3ForCausalLM": ("Phi-3 / Phi-3.5 / Phi-4 (fused qkv and gate_up, LongRoPE, partial rotary)", True),
    "StableLmForCausalLM": (
        "StableLM 2 / StableLM 3B (LayerNorm, partial rotary, parallel residual, QK LayerNorm)",
        True,
    ),
    "GlmForCausalLM": ("GLM-4 9B chat (partial interleaved rotary, fused gate_up)", True),
    "Glm4ForCausalLM": ("GLM-4 0414 (GLM plus post-attention and post-MLP norms)", True),
}

#: Mixture-of-experts members (Llama attention, FusedMoE feed-forward); tensor-parallel: every rank
#: holds all experts, each split along its intermediate features (``framework.layers.fused_moe``).
MOE_ARCHITECTURES = {
    "MixtralForCausalLM": "Mixtral 8x7B / 8x22B (softmax top-2 experts)",
    "Qwen2MoeForCausalLM": "Qwen1.5-MoE / Qwen2-MoE (routed experts + gated shared expert, q/k/v bias)",
    "Qwen3MoeForCausalLM": "Qwen3-MoE, e.g. Qwen3-30B-A3B (128 experts, top-8, QK norm)",
}


#: MiniMax-M2: the MoE decoder above with a bias-corrected sigmoid router and a QK norm across
#: all heads, which tensor parallelism would split (so one device).
MINIMAX_ARCHITECTURES = {
    "MiniMaxM2ForCausalLM": "MiniMax-M2 (sigmoid router with e_score_correction_bias, QK norm across heads, partial rotary)",
}

#: gpt-oss: Llama attention with sinks, biased experts with the clamped SwiGLU (``gpt_oss.py``).
GPT_OSS_ARCHITECTURES = {
    "GptOssForCausalLM": "gpt-oss-20b / 120b (attention sinks, alternate sliding window, YaRN; MXFP4 experts with fw-fp4)",
}

#: Llama 4 text: chunked / NoPE attention layers, a top-1 MoE scaled on its input (``llama4.py``).
LLAMA4_ARCHITECTURES = {
    "Llama4ForCausalLM": "Llama 4 Scout / Maverick text (chunked attention, NoPE layers, shared-expert top-1 MoE)",
}


#: GLM-4.5 MoE: Llama attention (partial NeoX rotary, optional QK norm), DeepSeek-V3's MoE (``glm4_moe.py``).
GLM4_MOE_ARCHITECTURES = {
    "Glm4MoeForCausalLM": "GLM-4.5 / 4.6 / 4.7 and -Air (sigmoid router with correction bias, shared experts; "
    "the MTP layer is skipped)",
}


#: Vision-language models (a vision tower feeding a Llama-family decoder).
VISION_ARCHITECTURES = {
    "Qwen2_5_VLForConditionalGeneration": "Qwen2.5-VL (image input: windowed ViT, M-RoPE; no video yet)",
    "Qwen3VLForConditionalGeneration": "Qwen3-VL dense (image input: ViT with learned positions, DeepStack, "
    "interleaved M-RoPE; no video yet)",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3-VL MoE, e.g. Qwen3-VL-30B-A3B (Qwen3-VL's tower, Qwen3-MoE text)",
    "Mistral3ForConditionalGeneration": "Mistral Small 3.1 / 3.2 (image input: Pixtral tower with 2-D RoPE, "
    "2x2 patch merger, [IMG_BREAK] / [IMG_END] layout tokens; Mistral text)",
    "Llama4ForConditionalGeneration": "Llama 4 Scout / Maverick (image input: tiles of a best-fit canvas and a "
    "global thumbnail, ViT with 2-D RoPE, pixel-shuffle adapter; Llama 4 text)",
}

#: the module of each vision architecture's class
VISION_MODULES = {
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl",
    "Mistral3ForConditionalGeneration": "mistral3",
    "Llama4ForConditionalGeneration": "llama4_vl",
}


@hookimpl
def register_model_architectures():
    return (
        [
            ModelSpec(
                name=name,
                impl="fw_llama.model:LlamaForCausalLM",
                description=description,
                supports_tensor_parallel=tensor_parallel,
            )
            for name, (description, tensor_parallel) in ARCHITECTURES.items()
        ]
        + [
            ModelSpec(
                name=name,
                impl="fw_llama.moe:LlamaMoeForCausalLM",
                description=description,
                supports_tensor_parallel=True,
            )
            for name, description in MOE_ARCHITECTURES.items()
        ]
        + [
            ModelSpec(name=name, impl="fw_llama.moe:LlamaMoeForCausalLM", description=description)
            for name, description in MINIMAX_ARCHITECTURES.items()
        ]
        + [
            ModelSpec(name=name, impl="fw_llama.gpt_oss:GptOssForCausalLM", description=description)
            for name, description in GPT_OSS_ARCHITECTURES.items()
        ]
        + [
            ModelSpec(
                name=name,
                impl="fw_llama.glm4_moe:Glm4MoeForCausalLM",
                description=description,
                supports_tensor_parallel=True,
            )
            for name, description in GLM4_MOE_ARCHITECTURES.items()
        ]
        + [
            ModelSpec(name=name, impl=f"fw_llama.llama4:{name}", description=description)
            for name, description in LLAMA4_ARCHITECTURES.items()
        ]
        + [
            ModelSpec(name=name, impl=f"fw_llama.{VISION_MODULES[name]}:{name}", description=description)
            for name, description in VISION_ARCHITECTURES.items()
        ]
    )
