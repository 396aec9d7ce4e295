"""The Llama family through the whole engine matches transformers (fp32, tiny random models).

Logits of a batch of mixed-length prompts at every position, and 32 greedy tokens, with a
prefill chunk smaller than the prompt, a prefix-cache hit, and a request preempted and resumed.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from framework import SamplingParams
from framework.testing import (
    check_greedy_parity,
    check_logits_parity,
    check_preemption_parity,
    check_prefix_cache_parity,
    write_tiny_model,
)

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)

CONFIGS = {
    "llama3_rope": lambda: transformers.LlamaConfig(**SMALL, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "llama_tied_mqa": lambda: transformers.LlamaConfig(**{**SMALL, "num_key_value_heads": 1}, tie_word_embeddings=True),
    "mistral_sliding_window": lambda: transformers.MistralConfig(**SMALL, sliding_window=7),
    "qwen2_qkv_bias": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=False),
}

PROMPTS = [[5, 9, 33, 2, 71], list(range(40, 53)), [int(x) for x in torch.randint(2, 160, (29,), generator=torch.Generator().manual_seed(1))]]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    reference = write_tiny_model(path, CONFIGS[request.param]())
    return path, reference


def test_batched_chunked_prefill_logits_match_transformers(tiny):
    check_logits_parity(*tiny, PROMPTS)


def test_greedy_tokens_match_transformers_with_chunked_prefill(tiny):
    check_greedy_parity(*tiny, PROMPTS)


def test_greedy_tokens_match_after_prefix_cache_hit(tiny):
    check_prefix_cache_parity(*tiny, PROMPTS)


def test_greedy_tokens_match_when_preempted_and_resumed(tiny):
    check_preemption_parity(*tiny, PROMPTS)
