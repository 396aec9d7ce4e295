"""Entry point of the ``gemma`` plugin: which architecture names it serves (no torch import)."""

from framework import hookimpl
from framework.specs import ModelSpec

#: HF ``architectures`` names served by the one Gemma implementation.
ARCHITECTURES = {
    "GemmaForCausalLM": "Gemma (1): GeGLU, (1 + w) RMSNorm, scaled embeddings",
    "Gemma2ForCausalLM": "Gemma 2: four norms per layer, alternating sliding window, soft-capped logits",
    "Gemma3ForCausalLM": "Gemma 3 text: 5 local : 1 global layers, QK norm, local and global RoPE bases",
}

#: Gemma 4 text: per-layer shapes, shared KV, per-layer inputs (``gemma4.py``); no tensor parallelism yet.
GEMMA4_ARCHITECTURES = {
    "Gemma4ForCausalLM": "Gemma 4 text: per-layer inputs, shared KV layers, proportional RoPE on global layers, GeGLU-experts MoE",
}

#: Gemma 3 with images (``gemma3_vl.py``): the SigLIP tower, its projector and the Gemma 3 decoder.
MULTIMODAL_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "Gemma 3 4B / 12B / 27B (image input: SigLIP tower, avg-pooled projector, "
    "bidirectional attention among an image's tokens; no pan-and-scan)",
}
#: Gemma 4 multimodal checkpoints: the text model of ``gemma4.py`` (vision / audio towers skipped).
GEMMA4_MULTIMODAL_ARCHITECTURES = {
    "Gemma4ForConditionalGeneration": "Gemma 4: the text model (vision and audio towers skipped at load)",
}

#: ``Gemma3TextConfig``'s defaults for the keys Google's multimodal configs leave out of ``text_config``
#: (gemma-3-4b-it lists only hidden_size, intermediate_size, num_hidden_layers, rope_scaling and sliding_window).
GEMMA3_TEXT_DEFAULTS = (
    ("vocab_size", 262_208),
    ("hidden_size", 2304),
    ("intermediate_size", 9216),
    ("num_hidden_layers", 26),
    ("num_attention_heads", 8),
    ("num_key_value_heads", 4),
    ("head_dim", 256),
    ("hidden_activation", "gelu_pytorch_tanh"),
    ("max_position_embeddings", 131_072),
    ("rms_norm_eps", 1e-6),
    ("query_pre_attn_scalar", 256),
    ("sliding_window", 4096),
    ("sliding_window_pattern", 6),
    ("rope_theta", 1_000_000.0),
    ("rope_local_base_freq", 10_000.0),
    ("tie_word_embeddings", True),
)


@hookimpl
def register_model_architectures():
    return (
        [
            ModelSpec(
                name=name,
                impl="fw_gemma.model:GemmaForCausalLM",
                description=description,
                supports_tensor_parallel=True,
            )
            for name, description in ARCHITECTURES.items()
        ]
        + [
            ModelSpec(
                name=name,
                impl="fw_gemma.gemma3_vl:Gemma3ForConditionalGeneration",
                description=description,
                supports_tensor_parallel=True,
                config_defaults=GEMMA3_TEXT_DEFAULTS,
            )
            for name, description in MULTIMODAL_ARCHITECTURES.items()
        ]
        + [
            ModelSpec(name=name, impl="fw_gemma.gemma4:Gemma4ForCausalLM", description=description)
            for name, description in GEMMA4_ARCHITECTURES.items()
        ]
        + [
            ModelSpec(name=name, impl="fw_gemma.multimodal:Gemma4ForConditionalGeneration", description=description)
            for name, description in GEMMA4_MULTIMODAL_ARCHITECTURES.items()
        ]
    )
