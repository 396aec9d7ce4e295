"""GGUF files of Gemma 4 text models (`gemma4`: E2B / E4B, 31B, 26B-A4B), as llama.cpp's
converter writes them, served by fw_gemma's ``Gemma4ForCausalLM``.

Metadata -> Hugging Face config (llama.cpp keys, `gemma4.` prefixed):

| GGUF (`gemma4.`) | HF | note |
| --- | --- | --- |
| `attention.sliding_window_pattern` | `layer_types` | per-layer bools (or a period) |
| `attention.key_length_swa` / `key_length` | `head_dim` / `global_head_dim` | both per layer in `per_layer_config` |
| `attention.head_count_kv` (per layer) | `num_key_value_heads` (the first sliding layer's) | per layer in `per_layer_config` |
| `attention.shared_kv_layers` | `num_kv_shared_layers` | default 0 |
| `feed_forward_length` (per layer) | `intermediate_size`, `use_double_wide_mlp` | doubled on the shared-KV layers |
| `embedding_length_per_layer_input` | `hidden_size_per_layer_input` | 0: no per-layer inputs |
| `rope.freq_base` / `rope.freq_base_swa` | full / sliding `rope_theta` | defaults 1e6 / 1e4 |
| `rope_freqs` tensor | full layers' `partial_rotary_factor` | "proportional" RoPE |
| `expert_count` / `expert_used_count` / `expert_feed_forward_length` | `num_experts` / `top_k_experts` / `moe_intermediate_size` | `enable_moe_block` |
| `final_logit_softcapping` | same | |

The converter keeps every norm as is (Gemma 4's norms multiply by ``w``, not ``1 + w``) and
stores what HF calls by other names: the router's ``scale`` as ``ffn_gate_inp.scale``, its
``per_expert_scale`` as ``ffn_down_exps.scale``, ``layer_scalar`` as ``layer_output_scale``,
the experts' ``gate_up_proj [E, 2I, H]`` whole as ``ffn_gate_up_exps`` (loaded as the gate and
up halves: :func:`split_gate_up`). Full-attention layers with ``attention_k_eq_v`` hold no
``attn_v`` (the model reads values from the key projection); shared-KV layers no K/V at all.
Proportional RoPE rotates the first ``partial_rotary_factor`` of each head's frequencies;
llama.cpp rotates all and sets the others' frequency factors to 1e30 (``rope_freqs``), whose
count of ones gives the factor back (:func:`proportional_rotary_factor`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: GGUF architectures served here -> HF (model_type, architectures[0]).
GEMMA4_ARCHITECTURES = {"gemma4": ("gemma4_text", "Gemma4ForCausalLM")}

SLIDING, FULL = "sliding_attention", "full_attention"

_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "ffn_gate_inp": "moe.router.proj",
    "pre_ffw_norm_2": "moe.pre_feedforward_layernorm_2",
    "post_ffw_norm_2": "moe.post_feedforward_layernorm_2",
    "ffn_gate_exps": "moe.experts.gate_proj",
    "ffn_up_exps": "moe.experts.up_proj",
    "ffn_down_exps": "moe.experts.down_proj",
    "ffn_gate_up_exps": "moe.experts.gate_up_proj",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
_GLOBAL_TENSORS = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}


def _per_layer(value: Any, num_layers: int, name: str) -> list[Any]:
    values = list(value) if isinstance(value, list | tuple) else [value] * num_layers
    if len(values) != num_layers:
        raise ValueError(f"gemma4.{name} has {len(values)} entries for {num_layers} layers")
    return values


def gemma4_config(key: Callable[..., Any], config: dict[str, Any], names: set[str] | None) -> dict[str, Any]:
    """The config keys of a `gemma4` file beyond the shared ones in `config` (the table above);
    `key(name, default)` reads `gemma4.name`. `attention_k_eq_v` needs the tensor names (a full
    layer with keys but no `attn_v`); the full layers' rotary factor is 1 until
    :func:`proportional_rotary_factor` reads the `rope_freqs` tensor."""
    num_layers = config["num_hidden_layers"]
    pattern = key("attention.sliding_window_pattern")
    is_swa = (
        [bool(x) for x in pattern]
        if isinstance(pattern, list)
        else [i % pattern < pattern - 1 for i in range(num_layers)]
    )
    if len(is_swa) != num_layers:
        raise ValueError(f"gemma4.attention.sliding_window_pattern has {len(is_swa)} entries for {num_layers} layers")
    types = [SLIDING if swa else FULL for swa in is_swa]
    kv_heads = _per_layer(
        key("attention.head_count_kv", config["num_attention_heads"]), num_layers, "attention.head_count_kv"
    )
    widths = _per_layer(key("feed_forward_length"), num_layers, "feed_forward_length")
    num_shared = key("attention.shared_kv_layers", 0)
    first_shared = num_layers - num_shared
    width = widths[0]
    double_wide = any(w != width for w in widths)
    expected = [width * (2 if double_wide and i >= first_shared else 1) for i in range(num_layers)]
    if widths != expected:
        raise ValueError(
            f"gemma4.feed_forward_length {widths}: fw's Gemma 4 takes one width, doubled on shared-KV layers"
        )
    swa_kv = [kv for kv, swa in zip(kv_heads, is_swa, strict=True) if swa] or kv_heads
    full_head_dim = key("attention.key_length")
    swa_head_dim = key("attention.key_length_swa")
    swa_rotary = key("rope.dimension_count_swa", swa_head_dim)
    if swa_rotary != swa_head_dim:
        raise ValueError(
            f"gemma4.rope.dimension_count_swa {swa_rotary}: fw rotates whole sliding heads ({swa_head_dim})"
        )
    k_eq_v = names is not None and any(
        f"blk.{i}.attn_k.weight" in names and f"blk.{i}.attn_v.weight" not in names
        for i in range(first_shared)
        if types[i] == FULL
    )
    num_experts = key("expert_count", 0)
    update: dict[str, Any] = {
        "layer_types": types,
        "head_dim": swa_head_dim,
        "num_key_value_heads": swa_kv[0],
        "global_head_dim": full_head_dim,
        "per_layer_config": {  # every layer's shape as the file states it
            i: {"head_dim": swa_head_dim if swa else full_head_dim, "num_key_value_heads": kv_heads[i]}
            for i, swa in enumerate(is_swa)
        },
        "attention_k_eq_v": k_eq_v,
        "num_kv_shared_layers": num_shared,
        "intermediate_size": width,
        "use_double_wide_mlp": double_wide,
        "hidden_size_per_layer_input": key("embedding_length_per_layer_input", 0),
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": key("rope.freq_base_swa", 10_000.0)},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 1.0, "rope_theta": key("rope.freq_base", 1e6)},
        },
        "final_logit_softcapping": key("final_logit_softcapping", None),
        "hidden_activation": "gelu_pytorch_tanh",
        "enable_moe_block": bool(num_experts),
    }
    if num_experts:
        update.update(
            {
                "num_experts": num_experts,
                "top_k_experts": key("expert_used_count"),
                "moe_intermediate_size": key("expert_feed_forward_length"),
            }
        )
    return update


def proportional_rotary_factor(freq_factors: list[float], head_dim: int) -> float:
    """The full layers' ``partial_rotary_factor`` from llama.cpp's ``rope_freqs`` (one factor per
    rotary pair of a ``head_dim`` head: 1 for the rotated pairs, 1e30 for the others)."""
    if len(freq_factors) != head_dim // 2:
        raise ValueError(f"rope_freqs has {len(freq_factors)} factors for heads of {head_dim}")
    rotated = sum(1 for f in freq_factors if f == 1.0)
    if any(f != 1.0 and f < 1e20 for f in freq_factors) or freq_factors[:rotated] != [1.0] * rotated:
        raise ValueError("rope_freqs is not a proportional-RoPE mask (ones, then 1e30s)")
    return 2 * rotated / head_dim


def gemma4_tensors() -> dict[str, str]:
    """Per-layer GGUF tensor name -> fw's name (without `blk.{i}.` / `model.layers.{i}.` and the suffix),
    beyond the shared attention, norm and MLP names; the MoE branch's tensors go straight under
    the layer's ``moe`` module."""
    return dict(_TENSORS)


def gemma4_names(num_layers: int) -> dict[str, str]:
    """The whole-model per-layer-input tensors and the per-layer tensors whose GGUF suffix differs from HF's."""
    names = dict(_GLOBAL_TENSORS)
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        names[f"blk.{i}.layer_output_scale.weight"] = f"{layer}.layer_scalar"
        names[f"blk.{i}.ffn_gate_inp.scale"] = f"{layer}.moe.router.scale"
        names[f"blk.{i}.ffn_down_exps.scale"] = f"{layer}.moe.router.per_expert_scale"
    return names


def gate_up_names(hf_name: str) -> tuple[str, str]:
    """The ``gate_proj`` and ``up_proj`` stack names of an ``experts.gate_up_proj`` stack."""
    base = hf_name.removesuffix(".gate_up_proj.weight")
    return f"{base}.gate_proj.weight", f"{base}.up_proj.weight"


def split_gate_up(hf_name: str, tensor: Any) -> list[tuple[str, Any]]:
    """``experts.gate_up_proj [E, 2I, ...]`` (a tensor or a lazy GGUF slice, packed rows or values)
    as FusedMoE's separate ``gate_proj`` / ``up_proj`` stacks, each ``[E, I, ...]``."""
    width = tensor.shape[1] // 2
    gate, up = gate_up_names(hf_name)
    return [(gate, tensor.narrow(1, 0, width)), (up, tensor.narrow(1, width, width))]


def complete_gemma4_config(config: dict[str, Any], tensors: dict[str, Any]) -> None:
    """What the config needs from the file's tensors (``{name: TensorInfo}``): the full layers'
    rotary factor from ``rope_freqs`` and the per-layer-input vocabulary from its embedding."""
    if (freqs := tensors.get("rope_freqs.weight")) is not None:
        factor = proportional_rotary_factor(freqs.dequantize().tolist(), config["global_head_dim"])
        config["rope_parameters"][FULL]["partial_rotary_factor"] = factor
    if (embedding := tensors.get("per_layer_token_embd.weight")) is not None:
        config["vocab_size_per_layer_input"] = embedding.shape[0]


def gemma4_tensor_types(types: dict[str, str]) -> dict[str, str]:
    """The GGUF types of the model's layers from the file's (``{fw name: type}``): a fused
    ``gate_up_proj`` stack types both halves, a key projection without a value projection
    (``attention_k_eq_v``) types the value shard it also fills."""
    out = {}
    for name, qtype in types.items():
        if name.endswith(".experts.gate_up_proj.weight"):
            out.update(dict.fromkeys(gate_up_names(name), qtype))
            continue
        out[name] = qtype
        value = name.replace(".self_attn.k_proj.", ".self_attn.v_proj.")
        if value != name and value not in types:
            out[value] = qtype
    return out
