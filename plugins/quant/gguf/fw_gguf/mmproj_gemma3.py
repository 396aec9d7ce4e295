"""Gemma 3's llama.cpp vision projector (``clip.projector_type`` ``gemma3``) as the SigLIP tower and
projector of ``fw_gemma``'s ``Gemma3ForConditionalGeneration``.

llama.cpp's converter (``Gemma3VisionModel``) keeps SigLIP's layout; it renames the tensors
(gguf-py's table), adds 1 to the projector's RMSNorm weight (Gemma's ``1 + w`` folded in) and
always writes the input projection in f16, the patch and position embeddings in f32::

    v.patch_embd.weight / .bias          [d, C, P, P]   vision_tower.embeddings.patch_embedding.*
    v.position_embd.weight               [N, d]         vision_tower.embeddings.position_embedding.weight
    v.blk.N.attn_q / attn_k / attn_v / attn_out         vision_tower.encoder.layers.N.self_attn.{q,k,v,out}_proj
    v.blk.N.ln1 / ln2 / ffn_up / ffn_down               ... .layer_norm1 / layer_norm2 / mlp.fc1 / mlp.fc2
    v.post_ln                                           vision_tower.post_layernorm
    mm.input_projection.weight           [d, hidden]    multi_modal_projector.mm_input_projection_weight
    mm.soft_emb_norm.weight              1 + w          multi_modal_projector.mm_soft_emb_norm.weight (w)

The image token count is the pooled grid's: ``(image_size / patch_size / k)^2`` for the pooling
kernel ``k`` = ``clip.vision.projector.scale_factor``, which the converter writes only where it is
not llama.cpp's default of 4 (every released Gemma 3: 896-pixel images, 14-pixel patches, 256
tokens). The image token ids come from the text GGUF's vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: llama.cpp's pooling kernel for a file that states none (``clip.cpp``: every Gemma 3 size)
DEFAULT_SCALE_FACTOR = 4

#: HF config keys -> the Gemma 3 tokens the text GGUF's vocabulary holds
GEMMA3_TOKENS = {
    "image_token_index": "<image_soft_token>",
    "boi_token_index": "<start_of_image>",
    "eoi_token_index": "<end_of_image>",
}

_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
_OTHER_NAMES = {
    "v.patch_embd.weight": "vision_tower.embeddings.patch_embedding.weight",
    "v.patch_embd.bias": "vision_tower.embeddings.patch_embedding.bias",
    "v.position_embd.weight": "vision_tower.embeddings.position_embedding.weight",
    "v.post_ln.weight": "vision_tower.post_layernorm.weight",
    "v.post_ln.bias": "vision_tower.post_layernorm.bias",
    "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
    "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
}
#: the weights the converter stored as ``1 + w``
SHIFTED = frozenset({"multi_modal_projector.mm_soft_emb_norm.weight"})

Key = Callable[..., Any]  # ``Projector._key``: (name, default=KeyError) -> clip.vision.{name}


def gemma3_weight_name(name: str) -> str | None:
    """fw's name of the projector tensor ``name``, or None for a tensor a Gemma 3 tower has no place for."""
    if name in _OTHER_NAMES:
        return _OTHER_NAMES[name]
    parts = name.split(".")
    if len(parts) == 5 and parts[:2] == ["v", "blk"] and parts[3] in _BLOCK_NAMES:
        return f"vision_tower.encoder.layers.{parts[2]}.{_BLOCK_NAMES[parts[3]]}.{parts[4]}"
    return None


def gemma3_vision_config(key: Key, num_channels: int) -> dict[str, Any]:
    """The SigLIP ``vision_config`` (transformers' keys) of the file's tower."""
    return {
        "model_type": "siglip_vision_model",
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": int(key("attention.head_count")),
        "image_size": int(key("image_size")),
        "patch_size": int(key("patch_size")),
        "layer_norm_eps": float(key("attention.layer_norm_epsilon", 1e-6)),
        "hidden_act": "gelu_pytorch_tanh",  # llama.cpp's GELU is the tanh approximation, as SigLIP's
        "num_channels": num_channels,
        "vision_use_head": False,
    }


def gemma3_mm_tokens_per_image(key: Key) -> int:
    """Image tokens per image: the patch grid's side pooled by the file's (or the default) kernel."""
    side = int(key("image_size")) // int(key("patch_size")) // int(key("projector.scale_factor", DEFAULT_SCALE_FACTOR))
    return side * side


def gemma3_preprocessor_config(key: Key) -> dict[str, Any]:
    """The Gemma 3 image processor's settings (``preprocessor_config.json`` keys): the square size,
    mean and std the file states."""
    size = int(key("image_size"))
    return {
        "size": {"height": size, "width": size},
        "image_mean": [float(x) for x in key("image_mean")],
        "image_std": [float(x) for x in key("image_std")],
    }


def gemma3_hf_config(
    text: dict[str, Any], vision: dict[str, Any], key: Key, token_ids: dict[str, int]
) -> dict[str, Any]:
    """``Gemma3ForConditionalGeneration``'s config: the text GGUF's ``text`` config (flat) with the
    tower's ``vision``, the image token count and the ids of :data:`GEMMA3_TOKENS` (``token_ids``:
    token -> id, from the vocabulary)."""
    config = dict(text)
    config.update(
        architectures=["Gemma3ForConditionalGeneration"],
        model_type="gemma3",
        vision_config=vision,
        mm_tokens_per_image=gemma3_mm_tokens_per_image(key),
        **{name: token_ids[token] for name, token in GEMMA3_TOKENS.items()},
    )
    return config
