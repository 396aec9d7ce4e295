"""The Gemma family through the whole engine matches transformers (fp32, tiny random models).

Logits of a batch of mixed-length prompts at every position (prefill chunks of 8, a sliding
window of 6 shorter than the prompts) and 32 greedy tokens. The RMSNorm weights, which
transformers initialises to zero (a (1 + w) identity), are randomised so that the norms, QK
norm included, count.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from framework import SamplingParams
from framework.testing import check_greedy_parity, check_logits_parity, reference_logits, write_tiny_model

SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.1,
)

CONFIGS = {
    # local layers: window 6, base 100; global layers: base 20000 with linear scaling x8; scale 1/sqrt(24)
    "gemma3_sliding_qk_norm": lambda: transformers.Gemma3TextConfig(
        **SMALL,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=6,
        query_pre_attn_scalar=24,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 20000.0},
        },
    ),
    # soft-caps small enough that tanh bends the scores and logits (see test_soft_caps_are_active)
    "gemma2_soft_caps": lambda: transformers.Gemma2Config(
        **SMALL,
        num_hidden_layers=3,
        sliding_window=6,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=2.0,
    ),
    "gemma1": lambda: transformers.GemmaConfig(**SMALL, num_hidden_layers=2),
}

PROMPTS = [
    [5, 9, 33, 2, 71],
    list(range(40, 53)),
    [int(x) for x in torch.randint(3, 160, (29,), generator=torch.Generator().manual_seed(1))],
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(one_thread, request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    reference = write_tiny_model(path, CONFIGS[request.param]())
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    reference.save_pretrained(path, safe_serialization=True)
    return path, reference


def test_batched_chunked_prefill_logits_match_transformers(tiny):
    check_logits_parity(*tiny, PROMPTS)


def test_greedy_tokens_match_transformers_with_chunked_prefill(tiny):
    check_greedy_parity(*tiny, PROMPTS)


def test_soft_caps_are_active():
    """The Gemma 2 config's caps bend transformers' logits far beyond the parity tolerance."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        CONFIGS["gemma2_soft_caps"](), attn_implementation="eager"
    ).eval()
    prompt = PROMPTS[2]
    capped = reference_logits(model, prompt)
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    uncapped_attention = reference_logits(model, prompt)
    model.config.final_logit_softcapping = None
    uncapped = reference_logits(model, prompt)
    scale = capped.abs().max()
    assert (uncapped_attention - capped).abs().max() > 0.05 * scale
    assert (uncapped - uncapped_attention).abs().max() > 0.05 * scale
