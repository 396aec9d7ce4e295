"""Write a Qwen2.5-VL / Qwen3-VL checkpoint as llama.cpp's ``convert_hf_to_gguf.py`` does: a text
GGUF (``--outtype f32``) and, with ``--mmproj``, the vision projector (``f32`` or ``f16``).

What the converter does, and this writer repeats (``Qwen2VLModel``, ``Qwen3VLTextModel``,
``Qwen2VLVisionModel``, ``Qwen3VLVisionModel`` and their ``MmprojModel`` base):

- text: ``model.language_model.*`` renamed ``model.*`` and mapped by gguf-py's table; the vision
  tensors skipped; ``{arch}.rope.dimension_sections`` (M-RoPE, padded to 4); Qwen3-VL's
  ``{arch}.n_deepstack_layers``; Qwen3-VL-MoE's fused expert stacks split per projection
  (``Qwen3VLMoeTextModel``);
- projector (``general.architecture`` ``clip``): ``clip.vision.*`` hyper-parameters, the
  preprocessor's mean and std, Qwen2.5-VL's ``n_wa_pattern`` (full-attention block period) and
  its q/k/v split out of ``qkv``, Qwen3-VL's merge size, DeepStack flags and ``v.deepstack.{block}``
  tensors, the Conv3D patch embedding split into one Conv2D weight per frame; with f16, tensors of
  two or more dimensions in f16 (Qwen2.5-VL's position table excepted), the rest f32.

The tokenizer is a byte-level BPE over the checkpoint's ids: its specials where the word-level
tokenizer has them, and ids 270..282 holding ``Ġ``, ``t``, ``Ġt`` and the digits, which is what the
Qwen 2 split makes of a prompt's words (``" t5"`` -> ``Ġt`` ``5``; other letters are dropped). The
prompt ids therefore differ from the word-level tokenizer's: tests hand fw's ids to transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from framework.testing.vision import VISION_CHAT_TEMPLATE

#: ids that hold the byte-level pieces of the prompts' words instead of the words
_CHARACTERS = {270 + i: c for i, c in enumerate(["Ġ", "t", "Ġt", *"0123456789"])}
_ARCHES = {"qwen2_5_vl": "qwen2vl", "qwen3_vl": "qwen3vl", "qwen3_vl_moe": "qwen3vlmoe"}
_PROJECTORS = {"qwen2_5_vl": "qwen2.5vl_merger", "qwen3_vl": "qwen3vl_merger"}


def _vocabulary(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of the byte-level vocabulary (see the module docstring)."""
    tokens = ["<s>", "</s>", *(f"Ġt{i}" for i in range(2, 290))]
    specials = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
    tokens += specials + [f"[PAD{i}]" for i in range(len(tokens) + len(specials), vocab_size)]
    for index, text in _CHARACTERS.items():
        tokens[index] = text
    types = [3 if t in ("<s>", "</s>", *specials) else 1 for t in tokens]
    return tokens, types, ["Ġ t"]


def write_text_gguf(hf_dir: Path, path: Path, matrix_type: Q = Q.F32) -> Path:
    """The text GGUF of the VL checkpoint in ``hf_dir``: weight matrices as ``matrix_type``
    (``llama-quantize``'s job after the converter), norms f32."""
    config = json.loads((hf_dir / "config.json").read_text())
    text, arch = config["text_config"], _ARCHES[config["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_rope_freq_base(float(text["rope_parameters"].get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    if arch == "qwen3vlmoe":
        writer.add_expert_count(text.get("num_experts", text.get("num_local_experts")))
        writer.add_expert_used_count(text["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(text["moe_intermediate_size"])
    if arch in ("qwen3vl", "qwen3vlmoe"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_num_deepstack_layers(len(config["vision_config"]["deepstack_visual_indexes"]))
    sections = list(text["rope_parameters"]["mrope_section"])
    writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    tokens, types, merges = _vocabulary(text["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(False)
    writer.add_chat_template(VISION_CHAT_TEMPLATE)
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(model_arch, text["num_hidden_layers"])
    for name, tensor in sorted(load_file(hf_dir / "model.safetensors").items()):
        name = name.replace("language_model.", "")
        if name.startswith(("model.visual.", "visual.")):
            continue  # the projector's
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            for stack_name, stack in _expert_stacks(name, tensor, text["hidden_size"]):
                writer.add_tensor(f"{names.get_name(stack_name)}.weight", stack.float().numpy())
            continue
        base, suffix = name.rsplit(".", 1)
        values = tensor.float().numpy()
        if tensor.dim() == 2 and matrix_type != Q.F32:
            writer.add_tensor(
                f"{names.get_name(base)}.{suffix}", gguf.quants.quantize(values, matrix_type), raw_dtype=matrix_type
            )
        else:
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", values)
    _finish(writer)
    return path


def _expert_stacks(name: str, tensor: torch.Tensor, hidden: int) -> list[tuple[str, torch.Tensor]]:
    """``Qwen3VLMoeTextModel.modify_tensors``: the released ``gate_up_proj [E, H, 2I]`` split into
    gate and up ``[E, I, H]``, ``down_proj [E, I, H]`` transposed to ``[E, H, I]`` (a checkpoint in
    transformers 5's ``[E, 2I, H]`` / ``[E, H, I]`` is first put in the released layout)."""
    base = name.rsplit(".", 1)[0]
    if name.endswith("gate_up_proj"):
        released = tensor if tensor.shape[1] == hidden else tensor.transpose(1, 2)
        gate, up = released.chunk(2, dim=-1)
        return [(f"{base}.gate_proj", gate.transpose(1, 2)), (f"{base}.up_proj", up.transpose(1, 2))]
    released = tensor if tensor.shape[2] == hidden else tensor.transpose(1, 2)
    return [(f"{base}.down_proj", released.transpose(1, 2))]


def write_mmproj(hf_dir: Path, path: Path, outtype: Q = Q.F32) -> Path:
    """The vision projector of the VL checkpoint in ``hf_dir`` (``outtype`` F32 or F16)."""
    from fw_llama.qwen2_vl_processor import processor_settings

    config = json.loads((hf_dir / "config.json").read_text())
    vision, kind = config["vision_config"], config["model_type"].removesuffix("_moe")
    preprocessor = processor_settings(json.loads((hf_dir / "preprocessor_config.json").read_text()))
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if outtype == Q.F32 else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(config["text_config"]["hidden_size"])
    image_size = vision.get("image_size", 560)
    if kind == "qwen3_vl":
        image_size = int(vision["num_position_embeddings"] ** 0.5 * vision["patch_size"])
    writer.add_vision_image_size(image_size)
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["depth"])
    writer.add_vision_head_count(vision["num_heads"])
    writer.add_vision_image_mean(preprocessor["image_mean"])
    writer.add_vision_image_std(preprocessor["image_std"])
    writer.add_clip_projector_type(_PROJECTORS[kind])
    if kind == "qwen2_5_vl":
        writer.add_vision_use_silu(True)
        writer.add_vision_n_wa_pattern(vision["fullatt_block_indexes"][0] + 1)
        writer.add_vision_attention_layernorm_eps(config.get("rms_norm_eps", 1e-6))
    else:
        writer.add_vision_use_gelu(True)
        writer.add_vision_spatial_merge_size(vision["spatial_merge_size"])
        writer.add_vision_attention_layernorm_eps(config["text_config"].get("rms_norm_eps", 1e-6))
        flags = [i in vision["deepstack_visual_indexes"] for i in range(vision["depth"])]
        writer.add_vision_is_deepstack_layers(flags)
    # the table numbers mm.{i} like blocks: released towers are deep enough to reach merger.mlp.2; this one too
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(vision["depth"], 3))
    for name, tensor in sorted(load_file(hf_dir / "model.safetensors").items()):
        name = name.removeprefix("model.")  # transformers 5 writes visual.*; the converter takes model.visual.* too
        if not name.startswith("visual."):
            continue
        for gguf_name, values in _projector_tensors(name, tensor, kind, vision, names):
            keep_f32 = outtype == Q.F32 or values.dim() < 2 or (kind == "qwen2_5_vl" and ".position_embd." in gguf_name)
            writer.add_tensor(gguf_name, values.float().numpy().astype(np.float32 if keep_f32 else np.float16))
    _finish(writer)
    return path


def _projector_tensors(
    name: str, tensor: torch.Tensor, kind: str, vision: dict, names
) -> list[tuple[str, torch.Tensor]]:
    """The converter's ``modify_tensors``: one checkpoint tensor -> its GGUF tensors."""
    if name == "visual.patch_embed.proj.weight":
        patch = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH]
        return [(f"{patch}.weight", tensor[:, :, 0]), (f"{patch}.weight.1", tensor[:, :, 1])]
    base, suffix = name.rsplit(".", 1)
    if name == "visual.patch_embed.proj.bias":
        return [(f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH]}.bias", tensor)]
    if kind == "qwen2_5_vl" and ".attn.qkv." in name:
        q, k, v = tensor.chunk(3, dim=0)
        return [(f"{names.get_name(base.replace('qkv', x))}.{suffix}", t) for x, t in zip("qkv", (q, k, v))]
    if kind == "qwen3_vl" and name.startswith("visual.deepstack_merger_list."):
        _, _, rank, part, suffix = name.split(".")
        block = vision["deepstack_visual_indexes"][int(rank)]
        kinds = {"norm": gguf.MODEL_TENSOR.V_DS_NORM, "linear_fc1": gguf.MODEL_TENSOR.V_DS_FC1}
        kinds["linear_fc2"] = gguf.MODEL_TENSOR.V_DS_FC2
        return [(f"{gguf.TENSOR_NAMES[kinds[part]].format(bid=block)}.{suffix}", tensor)]
    if kind == "qwen3_vl" and name.startswith("visual.merger."):
        part = name.split(".")[2]
        target = {"linear_fc1": "mm.0", "linear_fc2": "mm.2", "norm": "v.post_ln"}[part]
        return [(f"{target}.{suffix}", tensor)]
    return [(f"{names.get_name(base)}.{suffix}", tensor)]


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
