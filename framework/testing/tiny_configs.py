"""Tiny text configs that several test files build on, as keyword arguments of the transformers
config class (a fresh dict per call; ``overrides`` replace or add keys), so that a safetensors
parity test, a GGUF test and a vision-language writer of one family start from the same model."""

from __future__ import annotations

import copy
from typing import Any

_LLAMA4_TEXT = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=32,
    intermediate_size_mlp=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.1,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    no_rope_layer_interval=2,
    attention_chunk_size=8,
    floor_scale=4,
    attn_scale=0.5,
)

_GEMMA4_TEXT = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.1,
    sliding_window=6,
    final_logit_softcapping=3.0,
)

#: E2B's switches on five layers: K/V shared by the last two (double-wide MLPs), per-layer inputs,
#: keys as values on the global layers (one KV head of 32)
_GEMMA4_SHARED_KV = dict(
    num_hidden_layers=5,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    vocab_size_per_layer_input=160,
    hidden_size_per_layer_input=8,
)


def tiny_llama4_text(**overrides: Any) -> dict[str, Any]:
    """``Llama4TextConfig`` keywords: hidden 64, 4 layers of head_dim 16, MoE on every second layer
    (top-1 of 4 experts plus the shared expert), NoPE every second layer, chunks of 8 positions on
    the RoPE layers, ``floor_scale`` 4 (the temperature tuning scales queries from position 3 on)."""
    return {**copy.deepcopy(_LLAMA4_TEXT), **overrides}


def tiny_gemma4_text(shared_kv: bool = False, **overrides: Any) -> dict[str, Any]:
    """``Gemma4TextConfig`` keywords: hidden 64, head_dim 16, sliding window 6, final-logit
    soft-capping 3 (the layer count and types are the caller's); with ``shared_kv`` E2B's
    switches on 5 layers (shared K/V on the last two with double-wide MLPs, per-layer inputs,
    ``attention_k_eq_v`` on the global layers of head_dim 32)."""
    return {**copy.deepcopy({**_GEMMA4_TEXT, **(_GEMMA4_SHARED_KV if shared_kv else {})}), **overrides}
