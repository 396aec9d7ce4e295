"""The Llama family through the whole engine matches transformers (fp32, tiny random models).

Logits of a batch of mixed-length prompts at every position, and 32 greedy tokens, with a
prefill chunk smaller than the prompt, a prefix-cache hit, and a request preempted and resumed.
"""

from __future__ import annotations

import transformers

from framework.testing import (
    ModelParityTests,
    tiny_model_fixture,
)

SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
)

CONFIGS = {
    "llama3_rope": lambda: transformers.LlamaConfig(
        **SMALL,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama_tied_mqa": lambda: transformers.LlamaConfig(**{**SMALL, "num_key_value_heads": 1}, tie_word_embeddings=True),
    "mistral_sliding_window": lambda: transformers.MistralConfig(**SMALL, sliding_window=7),
    "qwen2_qkv_bias": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=False),
}


tiny = tiny_model_fixture(CONFIGS)


class TestParity(ModelParityTests):
    """Logits and greedy ids against transformers: batched chunked prefill, a prefix-cache hit, preemption."""
