"""GGUF files of the DeepSeek-V3-style MoE models: `deepseek2` (DeepSeek-V2/V3/R1, GLM-4.7-Flash)
and `glm4moe` (GLM-4.5/4.6/4.7), as llama.cpp's converter writes them.

Metadata -> Hugging Face config (llama.cpp keys, `{arch}.` prefixed):

| GGUF (`{arch}.`) | HF | note |
| --- | --- | --- |
| `expert_count` / `expert_used_count` | `n_routed_experts` / `num_experts_per_tok` | |
| `expert_feed_forward_length` / `expert_shared_count` | `moe_intermediate_size` / `n_shared_experts` | |
| `leading_dense_block_count` | `first_k_dense_replace` | |
| `expert_weights_scale` / `expert_weights_norm` | `routed_scaling_factor` / `norm_topk_prob` | defaults 1.0 / false |
| `expert_group_count` / `expert_group_used_count` | `n_group` / `topk_group` | default 1 |
| `expert_gating_func` | 2 (sigmoid): DeepSeek-V3; 1 or absent (softmax): DeepSeek-V2 | deepseek2 |
| `attention.q_lora_rank` / `kv_lora_rank` | same | deepseek2; V2-Lite: no q_lora_rank |
| `attention.key_length_mla` / `value_length_mla` | nope + rope head dims / `v_head_dim` | old files: `key_length` |
| `rope.scaling.yarn_log_multiplier` | `0.1 * mscale_all_dim` (= `mscale` in every release) | deepseek2 |
| `nextn_predict_layers` | MTP blocks in `block_count`: not built, tensors skipped | glm4moe |

Tensors beyond the shared table of ``fw_gguf.config``: the MLA projections, the router's
`exp_probs_b.bias` (`e_score_correction_bias`), the shared experts (`mlp.shared_experts`), and
llama.cpp's split `attn_k_b` `[H, L, N]` / `attn_v_b` `[H, V, L]` which :func:`kv_b_from_split`
joins back into HF's `kv_b_proj` `[H * (N + V), L]`. The router and `kv_b_proj` load as floats
(fw keeps both unquantized: the router in float32, `kv_b_proj` absorbed into the attention).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: GGUF architectures served here -> HF (model_type, architectures[0]) when the router is sigmoid.
GROUPED_MOE_ARCHITECTURES = {
    "deepseek2": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "glm4moe": ("glm4_moe", "Glm4MoeForCausalLM"),
}

_GATING_SIGMOID = 2

_MOE_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_MLA_TENSORS = {
    "attn_q": "self_attn.q_proj",  # V2-Lite: no query compression
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # files converted before llama.cpp split it
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
}


def grouped_moe_config(arch: str, key: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    """The config keys of a `deepseek2` / `glm4moe` file beyond the shared ones in `config` (the
    table in the module docstring); `key(name, default)` reads `{arch}.name`."""
    update: dict[str, Any] = {
        "n_routed_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "n_shared_experts": key("expert_shared_count", 0),
        "first_k_dense_replace": key("leading_dense_block_count", 0),
        "routed_scaling_factor": float(key("expert_weights_scale", 1.0) or 1.0),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "n_group": key("expert_group_count", 1) or 1,
        "topk_group": key("expert_group_used_count", 1) or 1,
    }
    if arch == "glm4moe":
        num_layers = config["num_hidden_layers"] - key("nextn_predict_layers", 0)
        head_dim = config["head_dim"]
        rotary = key("rope.dimension_count", head_dim) / head_dim
        return {**update, "num_hidden_layers": num_layers, "partial_rotary_factor": rotary}
    rope_dim = key("rope.dimension_count")
    qk_head_dim = key("attention.key_length_mla", None) or key("attention.key_length")
    update.update(
        {
            "q_lora_rank": key("attention.q_lora_rank", None),
            "kv_lora_rank": key("attention.kv_lora_rank"),
            "qk_rope_head_dim": rope_dim,
            "qk_nope_head_dim": qk_head_dim - rope_dim,
            "v_head_dim": key("attention.value_length_mla", None) or key("attention.value_length"),
            "head_dim": rope_dim,  # transformers' DeepSeek configs alias head_dim to the rotary width
            "num_key_value_heads": config["num_attention_heads"],  # llama.cpp writes 1 (MLA as MQA); HF: the heads
        }
    )
    if (scaling := config.get("rope_scaling")) and (log_mul := key("rope.scaling.yarn_log_multiplier", None)):
        update["rope_scaling"] = {**scaling, "mscale": log_mul / 0.1, "mscale_all_dim": log_mul / 0.1}
    if key("expert_gating_func", None) != _GATING_SIGMOID:  # DeepSeek-V2: softmax routing
        grouped = update["n_group"] > 1
        update.update(
            {
                "architectures": ["DeepseekV2ForCausalLM"],
                "model_type": "deepseek_v2",
                "topk_method": "group_limited_greedy" if grouped else "greedy",
            }
        )
    return update


def grouped_moe_tensors(arch: str) -> dict[str, str]:
    """Per-layer GGUF tensor name -> HF name (without `blk.{i}.` / `model.layers.{i}.` and the suffix)."""
    tensors = dict(_MOE_TENSORS)
    if arch == "deepseek2":
        tensors.update(_MLA_TENSORS)
    else:  # glm4moe: the norm after attention keeps llama.cpp's post-attention name
        tensors["post_attention_norm"] = "post_attention_layernorm"
    return tensors


def correction_bias_names(num_layers: int) -> dict[str, str]:
    """llama.cpp's `exp_probs_b.bias` is HF's `mlp.gate.e_score_correction_bias` (no `.bias` suffix there)."""
    return {
        f"blk.{i}.exp_probs_b.bias": f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(num_layers)
    }


def loads_as_float(hf_name: str) -> bool:
    """The matrices fw keeps unquantized for these models: the router and MLA's `kv_b_proj` (and its split halves)."""
    return hf_name.endswith((".mlp.gate.weight", ".kv_b_proj.weight", ".k_b_proj.weight", ".v_b_proj.weight"))


def kv_b_from_split(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """HF's `kv_b_proj.weight` `[H * (N + V), L]` from llama.cpp's `attn_k_b` `[H, L, N]` (each
    head's W_UK, transposed) and `attn_v_b` `[H, V, L]`::

        kv_b_proj rows of head h:  [ W_UK[h] (N rows) ; W_UV[h] (V rows) ],  W_UK[h] = k_b[h].T
    """
    heads, rank, _ = k_b.shape
    if v_b.shape[0] != heads or v_b.shape[2] != rank:
        raise ValueError(f"attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} do not come from one kv_b_proj")
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, rank).contiguous()
