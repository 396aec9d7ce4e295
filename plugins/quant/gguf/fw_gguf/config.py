"""Hugging Face style configs and checkpoint names for GGUF models.

A GGUF carries no `config.json`: its metadata (llama.cpp key names, `{arch}.` prefixed) is the
config. `hf_config_from_gguf` rebuilds the `config.json` dict a Hugging Face checkpoint of the same
model would have, `tensor_name_map` renames GGUF tensors to that checkpoint's names, and
`unpermute_qk` undoes the one layout change llama.cpp makes to llama-architecture weights.

Values llama.cpp hard-codes instead of storing follow llama.cpp (`src/llama-model.cpp`):
Gemma 2 alternates sliding/full layers, Gemma 3 has one full layer in six and a local RoPE base
of 10000, and both scale queries by `hidden_size / num_heads` for the 27B models only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .gemma4 import GEMMA4_ARCHITECTURES, gemma4_config, gemma4_names, gemma4_tensors
from .gpt_oss import GPT_OSS_ARCHITECTURES, gpt_oss_config, gpt_oss_names, gpt_oss_tensors
from .grouped_moe import GROUPED_MOE_ARCHITECTURES, correction_bias_names, grouped_moe_config, grouped_moe_tensors
from .hybrid import HYBRID_ARCHITECTURES, HYBRID_MOE, hybrid_config, hybrid_layer_names, hybrid_tensors
from .llama4 import LLAMA4_ARCHITECTURES, llama4_config, llama4_tensors

# GGUF `general.architecture` -> (HF model_type, HF architectures[0])
HF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    # Qwen2.5-VL / Qwen3-VL text: served as the VL model with an mmproj file (``fw_gguf.mmproj``), else as text
    "qwen2vl": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3vl": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3vlmoe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "stablelm": ("stablelm", "StableLmForCausalLM"),
    "glm4": ("glm4", "Glm4ForCausalLM"),
    **GROUPED_MOE_ARCHITECTURES,  # deepseek2 (softmax-routed files: DeepseekV2ForCausalLM), glm4moe
    **HYBRID_ARCHITECTURES,  # qwen35, qwen35moe, qwen3next (Gated DeltaNet hybrids)
    **LLAMA4_ARCHITECTURES,  # llama4 (text)
    **GEMMA4_ARCHITECTURES,  # gemma4 (text)
    **GPT_OSS_ARCHITECTURES,  # gpt-oss (MXFP4 experts)
}

_GEMMA = ("gemma2", "gemma3")
_MOE = ("qwen2moe", "qwen3moe", "qwen3vlmoe")
# block counts of the 27B Gemmas, the only sizes llama.cpp scales queries by hidden/heads
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _unsupported(arch: str) -> ValueError:
    return ValueError(
        f"GGUF architecture {arch!r} is not supported by fw_gguf; supported: {', '.join(HF_ARCHITECTURES)}"
    )


def _rope_scaling(md: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """`{arch}.rope.scaling.*` -> HF `rope_scaling`, or None when the file states no scaling.

    llama3-style scaling is not metadata in GGUF but a `rope_freqs.weight` tensor of per-dimension
    factors; the weight format rebuilds it from that tensor (``fw_gguf.rope_freqs``).
    """
    p = f"{arch}.rope.scaling."
    kind = md.get(p + "type")
    factor = md.get(p + "factor", md.get(f"{arch}.rope.scale_linear"))
    if kind in (None, "none") and factor in (None, 1.0):
        return None
    scaling: dict[str, Any] = {"rope_type": kind or "linear", "factor": factor}
    if (orig := md.get(p + "original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = orig
    for gguf_key, hf_key in (
        ("attn_factor", "attention_factor"),
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
    ):
        if (value := md.get(p + gguf_key)) is not None:
            scaling[hf_key] = value
    return scaling


def _layer_types(md: dict[str, Any], arch: str, num_layers: int) -> list[str]:
    # llama.cpp: pattern n means layers il with il % n < n - 1 use the sliding window
    pattern = md.get(f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):
        is_swa = [bool(x) for x in pattern]
    else:
        is_swa = [i % pattern < pattern - 1 for i in range(num_layers)]
    return ["sliding_attention" if s else "full_attention" for s in is_swa]


def hf_config_from_gguf(metadata: dict[str, Any], tensor_names: Iterable[str] | None = None) -> dict[str, Any]:
    """The Hugging Face `config.json` dict for a GGUF model with this metadata.

    Covers llama (also Mistral/SmolLM stored as llama), qwen2, qwen3 (and their VL text models
    qwen2vl, qwen3vl and qwen3vlmoe, as text: ``fw_gguf.mmproj`` adds the vision tower), qwen2moe, qwen3moe, gemma2,
    gemma3 (text: ``fw_gguf.mmproj`` adds Gemma 3's vision tower), phi3, stablelm, glm4, deepseek2 and glm4moe (``fw_gguf.grouped_moe``), qwen35,
    qwen35moe and qwen3next (``fw_gguf.hybrid``), llama4 (``fw_gguf.llama4``) and gemma4
    (``fw_gguf.gemma4``) and gpt-oss (``fw_gguf.gpt_oss``); raises `ValueError` listing those for any other architecture and `KeyError` naming a
    missing required key. Keys follow transformers' config classes; RoPE is stated the
    `config.json` way (`rope_theta`, `rope_scaling`, plus `rope_local_base_freq` for Gemma 3),
    which transformers converts to `rope_parameters`. `tie_word_embeddings` needs `tensor_names`
    (llama.cpp omits `output.weight` when the head is tied); without them the key is left out.
    """
    arch = metadata["general.architecture"]
    if arch not in HF_ARCHITECTURES:
        raise _unsupported(arch)
    model_type, architecture = HF_ARCHITECTURES[arch]

    def key(name: str, default: Any = KeyError) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is KeyError:
            raise KeyError(f"GGUF metadata lacks {arch}.{name}, which {arch} models need")
        return value

    hidden_size = key("embedding_length")
    num_layers = key("block_count")
    num_heads = key("attention.head_count")
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer counts; fw's models take one value
        num_kv_heads = max(num_kv_heads)
    # as llama.cpp: key_length, else hidden / heads (rope.dimension_count is the rotary width)
    head_dim = key("attention.key_length", None) or hidden_size // num_heads
    tokens = metadata.get("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden_size,
        # MoE files may omit the dense width (every layer sparse): the expert width stands in
        "intermediate_size": key(
            "feed_forward_length",
            key("expert_feed_forward_length", None)
            if arch in (*_MOE, *HYBRID_MOE, *GPT_OSS_ARCHITECTURES)
            else KeyError,
        ),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": key(
            "attention.layer_norm_epsilon" if arch == "stablelm" else "attention.layer_norm_rms_epsilon"
        ),
        "rope_theta": key("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(metadata, arch),
        "max_position_embeddings": key("context_length"),
        "vocab_size": key("vocab_size", len(tokens) if tokens is not None else None),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "sliding_window": key("attention.sliding_window", None),
        "hidden_act": "silu",
    }
    names = set(tensor_names) if tensor_names is not None else None
    if names is not None:
        config["tie_word_embeddings"] = "output.weight" not in names
    if config["vocab_size"] is None:
        raise KeyError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")

    if arch == "llama" and names is not None:
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    elif arch in ("qwen2", "qwen2vl"):
        config["use_sliding_window"] = False
    elif arch in _MOE:
        config.update(_moe_config(arch, key, num_layers, names))
    elif arch in HYBRID_ARCHITECTURES:
        config.update(hybrid_config(arch, key, config))
    elif arch in GEMMA4_ARCHITECTURES:
        for name in ("hidden_act", "rope_theta", "rope_scaling"):  # Gemma 4 states RoPE per layer type
            del config[name]
        config.update(gemma4_config(key, config, names))
        if names is not None:
            config["attention_bias"] = "blk.0.attn_q.bias" in names
    elif arch in LLAMA4_ARCHITECTURES:
        config.update(llama4_config(key, config, names))
        if names is not None:
            config["attention_bias"] = "blk.0.attn_q.bias" in names
    elif arch in GPT_OSS_ARCHITECTURES:
        config.update(gpt_oss_config(key, config, names))
    elif arch in GROUPED_MOE_ARCHITECTURES:
        config.update(grouped_moe_config(arch, key, config))
        if arch == "glm4moe" and names is not None:
            config["attention_bias"] = "blk.0.attn_q.bias" in names
            config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in names
    elif arch == "phi3":
        config["partial_rotary_factor"] = key("rope.dimension_count", head_dim) / head_dim
        if (original := key("rope.scaling.original_context_length", None)) is not None:
            config["original_max_position_embeddings"] = original
    elif arch == "glm4":
        config["partial_rotary_factor"] = key("rope.dimension_count", head_dim) / head_dim
        if names is not None:
            config["attention_bias"] = "blk.0.attn_q.bias" in names
    elif arch == "stablelm":
        # LayerNorm eps; llama.cpp tells the variants apart by which tensors exist
        config["layer_norm_eps"] = config.pop("rms_norm_eps")
        config["partial_rotary_factor"] = key("rope.dimension_count", head_dim) / head_dim
        if names is not None:
            config["use_qkv_bias"] = "blk.0.attn_q.bias" in names
            config["qk_layernorm"] = "blk.0.attn_q_norm.weight" in names
            config["use_parallel_residual"] = "blk.0.ffn_norm.weight" not in names
    elif arch in _GEMMA:
        del config["hidden_act"]
        config["hidden_activation"] = "gelu_pytorch_tanh"
        if (scale := key("attention.scale", None)) is not None:
            config["query_pre_attn_scalar"] = round(scale**-2)
        elif num_layers == _GEMMA_27B_LAYERS[arch]:
            config["query_pre_attn_scalar"] = hidden_size // num_heads
        else:
            config["query_pre_attn_scalar"] = head_dim
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            config[name] = key(name, None)
        config["layer_types"] = _layer_types(metadata, arch, num_layers)
        if arch == "gemma3":
            config["rope_local_base_freq"] = key("rope.freq_base_swa", 10000.0)
            pattern = key("attention.sliding_window_pattern", 6)
            if isinstance(pattern, int):
                config["sliding_window_pattern"] = pattern
    return config


def _moe_config(arch: str, key, num_layers: int, names: set[str] | None) -> dict[str, Any]:
    """The Qwen-MoE keys: experts, their width, the shared expert (qwen2moe), top-k renormalisation
    (llama.cpp: on for qwen3moe, off for qwen2moe, unless `expert_weights_norm` says), and which
    layers are dense (those without a router tensor, when the tensor names are known)."""
    config: dict[str, Any] = {
        "num_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "norm_topk_prob": bool(key("expert_weights_norm", arch in ("qwen3moe", "qwen3vlmoe"))),
        "decoder_sparse_step": 1,
        "use_sliding_window": False,
    }
    if names is not None:
        config["mlp_only_layers"] = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = key("expert_shared_feed_forward_length")
    return config


_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Qwen-MoE: the router, the experts stacked per projection ([experts, out, in]) and the shared expert
_MOE_LAYER_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}

# Gemma's four norms per layer: llama.cpp's ffn_norm is HF's pre_feedforward_layernorm
_GEMMA_LAYER_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def tensor_name_map(arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face checkpoint name, for every tensor such a model may hold.

    Both `.weight` and `.bias` names are listed (biases exist for qwen2's q/k/v). Phi-3 keeps its
    fused `qkv_proj` and `gate_up_proj` (`ffn_up` there), GLM-4 its fused `gate_up_proj`. StableLM's QK norms map to
    `self_attn.q_layernorm` / `k_layernorm`, one `[heads, head_dim]` tensor that
    `split_per_head_norm` turns into HF's per-head `norms.{h}.weight`. llama.cpp-only tensors with
    no HF checkpoint counterpart (`rope_freqs`, `rope_factors_long/short`) are absent. Raises
    `ValueError` for architectures outside `HF_ARCHITECTURES`.
    """
    if arch not in HF_ARCHITECTURES:
        raise _unsupported(arch)
    per_layer = dict(_LAYER_TENSORS)
    if arch in _GEMMA:
        per_layer.update(_GEMMA_LAYER_TENSORS)
    if arch == "phi3":
        per_layer["ffn_up"] = "mlp.gate_up_proj"
    if arch in _MOE:
        per_layer.update(_MOE_LAYER_TENSORS)
    if arch == "glm4":  # fused gate_up as Phi-3; two extra norms per layer
        per_layer.update(
            {
                "ffn_up": "mlp.gate_up_proj",
                "post_attention_norm": "post_self_attn_layernorm",
                "post_ffw_norm": "post_mlp_layernorm",
            }
        )
    if arch == "stablelm":
        per_layer.update({"attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm"})
    if arch in GROUPED_MOE_ARCHITECTURES:
        per_layer.update(grouped_moe_tensors(arch))
    if arch in LLAMA4_ARCHITECTURES:
        per_layer.update(llama4_tensors())
    if arch in GEMMA4_ARCHITECTURES:
        per_layer.update(gemma4_tensors())
    if arch in GPT_OSS_ARCHITECTURES:
        per_layer.update(gpt_oss_tensors())
    if arch in HYBRID_ARCHITECTURES:
        per_layer.update({**(_MOE_LAYER_TENSORS if arch in HYBRID_MOE else {}), **hybrid_tensors(arch)})
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output_norm.bias": "model.norm.bias",  # LayerNorm models (StableLM)
        "output.weight": "lm_head.weight",
    }
    for i in range(num_layers):
        for gguf_name, hf_name in per_layer.items():
            for suffix in (".weight", ".bias"):
                names[f"blk.{i}.{gguf_name}{suffix}"] = f"model.layers.{i}.{hf_name}{suffix}"
    if arch in GROUPED_MOE_ARCHITECTURES:
        names.update(correction_bias_names(num_layers))
    if arch in HYBRID_ARCHITECTURES:
        names.update(hybrid_layer_names(num_layers))
    if arch in GEMMA4_ARCHITECTURES:
        names.update(gemma4_names(num_layers))
    if arch in GPT_OSS_ARCHITECTURES:
        names.update(gpt_oss_names(num_layers))
    return names


def split_per_head_norm(hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """StableLM's per-head QK LayerNorm: llama.cpp stacks the heads' weights into one
    `[heads, head_dim]` tensor; HF keeps `q_layernorm.norms.{h}.weight` per head."""
    base, suffix = hf_name.rsplit(".", 1)
    return [(f"{base}.norms.{h}.{suffix}", row) for h, row in enumerate(tensor)]


def norm_weight_offset(arch: str) -> float:
    """What llama.cpp added to RMSNorm weights: 1.0 for Gemma and the Qwen3.5 / Qwen3-Next hybrids
    (it stores `1 + w`, HF stores `w`; the hybrids' DeltaNet output norm excepted:
    `fw_gguf.hybrid.norm_is_shifted`)."""
    return 1.0 if arch in _GEMMA or arch == "gemma" or arch in HYBRID_ARCHITECTURES else 0.0


def qk_unpermute_heads(metadata: dict[str, Any], gguf_name: str) -> int | None:
    """The head count to pass to `unpermute_qk` for this tensor, or None when it needs none.

    llama.cpp's converter permutes q/k rows (weights and biases) of `llama` models only (Mistral
    and SmolLM are stored as llama too); qwen2/qwen3/gemma/phi3 rope in NeoX order and are stored
    as is. q uses `head_count`, k `head_count_kv`.
    """
    if metadata.get("general.architecture") != "llama":
        return None
    num_heads = metadata["llama.attention.head_count"]
    if ".attn_q." in gguf_name:
        return num_heads
    if ".attn_k." in gguf_name:
        return metadata.get("llama.attention.head_count_kv", num_heads)
    return None


def qk_unpermute_index(num_rows: int, num_heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: `hf_rows = gguf_rows[index]`.

    Within each head llama.cpp interleaves the two rotary halves (row `2i + j` holds HF row
    `j * half + i`); gathering rows with this index restores HF's half-split order:

        gguf rows of a head: [x0 y0 x1 y1 ... ]  ->  HF rows: [x0 x1 ... | y0 y1 ...]
    """
    if num_rows % (2 * num_heads):
        raise ValueError(f"{num_rows} rows do not split into {num_heads} heads of two rotary halves")
    half = num_rows // num_heads // 2
    rows = torch.arange(num_rows, device=device)
    return rows.reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)


def unpermute_qk(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (as transformers' `reverse_permute_weights` does).

    Works on dequantized weights `[rows, in_features]`, biases `[rows]` and packed GGUF rows
    `[rows, bytes_per_row]` alike, since it only reorders whole rows; so it may run before
    dequantization: `dequantize(unpermute_qk(packed, h)) == unpermute_qk(dequantize(packed), h)`.
    """
    index = qk_unpermute_index(tensor.shape[0], num_heads, tensor.device)
    return tensor.index_select(0, index)
