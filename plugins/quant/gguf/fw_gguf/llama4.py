"""GGUF files of Llama 4 text models (`llama4`: Scout, Maverick, MobileLLM-R1), as llama.cpp's
converter writes them, served by fw_llama's ``Llama4ForCausalLM``.

Metadata -> Hugging Face config (llama.cpp keys, `llama4.` prefixed):

| GGUF (`llama4.`) | HF | note |
| --- | --- | --- |
| `feed_forward_length` | `intermediate_size_mlp` | the dense layers' width (the converter swaps the two widths) |
| `expert_feed_forward_length` | `intermediate_size` | experts' and shared expert's width |
| `expert_count` / `expert_used_count` | `num_local_experts` / `num_experts_per_tok` | |
| `interleave_moe_layer_step` | `interleave_moe_layer_step`, `moe_layers` | required, as in llama.cpp |
| `attention.sliding_window` = 0 | every layer RoPE, full attention | MobileLLM-R1; absent or other: Scout's pattern |

What llama.cpp hard-codes instead of storing (``src/llama-model.cpp``, ``LLM_ARCH_LLAMA4``) is
given back explicitly: chunks of 8192 positions on the RoPE layers, every 4th layer NoPE with
temperature-tuned queries (``floor_scale`` 8192, ``attn_scale`` 0.1), and the weightless QK norm
on all but the 128-expert model (Maverick). The converter leaves q/k unpermuted (Llama 4 rotates
interleaved pairs, as llama.cpp does) and stores the experts as the other MoE files do: its
``gate_up_proj [E, H, 2I]`` split and transposed into ``ffn_gate_exps`` / ``ffn_up_exps``
``[E, I, H]``, ``down_proj [E, I, H]`` transposed into ``ffn_down_exps [E, H, I]``: the
per-projection stacks FusedMoE loads as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: GGUF architectures served here -> HF (model_type, architectures[0]).
LLAMA4_ARCHITECTURES = {"llama4": ("llama4_text", "Llama4ForCausalLM")}

CHUNK_SIZE = 8192  # llama.cpp: n_swa, "the same for Scout and Maverick"
NO_ROPE_LAYER_STEP = 4  # llama.cpp: n_no_rope_layer_step's default
FLOOR_SCALE = 8192  # n_attn_temp_floor_scale
ATTN_SCALE = 0.1  # f_attn_temp_scale
_MAVERICK_EXPERTS = 128  # llama.cpp's LLM_TYPE_17B_128E: no QK norm

_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
    "ffn_gate_inp": "feed_forward.router",
    "ffn_gate_exps": "feed_forward.experts.gate_proj",
    "ffn_up_exps": "feed_forward.experts.up_proj",
    "ffn_down_exps": "feed_forward.experts.down_proj",
    "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
    "ffn_up_shexp": "feed_forward.shared_expert.up_proj",
    "ffn_down_shexp": "feed_forward.shared_expert.down_proj",
}


def llama4_config(key: Callable[..., Any], config: dict[str, Any], names: set[str] | None) -> dict[str, Any]:
    """The config keys of a `llama4` file beyond the shared ones in `config` (the table above);
    `key(name, default)` reads `llama4.name`. MoE layers are those holding a router when the
    tensor names are known, else every `interleave_moe_layer_step`-th."""
    num_layers = config["num_hidden_layers"]
    step = key("interleave_moe_layer_step")
    num_experts = key("expert_count", 0)
    all_rope = key("attention.sliding_window", None) == 0
    no_rope = [1 if all_rope else int((i + 1) % NO_ROPE_LAYER_STEP != 0) for i in range(num_layers)]
    if names is not None:
        moe_layers = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
    else:
        moe_layers = [i for i in range(num_layers) if num_experts and step and (i + 1) % step == 0]
    return {
        "intermediate_size": key("expert_feed_forward_length", config["intermediate_size"]),
        "intermediate_size_mlp": config["intermediate_size"],
        "num_local_experts": num_experts,
        "num_experts_per_tok": key("expert_used_count", 1),
        "interleave_moe_layer_step": step,
        "moe_layers": moe_layers,
        "no_rope_layers": no_rope,
        "layer_types": ["chunked_attention" if rope and not all_rope else "full_attention" for rope in no_rope],
        "attention_chunk_size": None if all_rope else CHUNK_SIZE,
        "use_qk_norm": num_experts != _MAVERICK_EXPERTS,
        "attn_temperature_tuning": True,
        "floor_scale": FLOOR_SCALE,
        "attn_scale": ATTN_SCALE,
        "sliding_window": None,  # the chunks are not a sliding window
    }


def llama4_tensors() -> dict[str, str]:
    """Per-layer GGUF tensor name -> HF name (without `blk.{i}.` / `model.layers.{i}.` and the suffix),
    beyond the shared attention names."""
    return dict(_TENSORS)
