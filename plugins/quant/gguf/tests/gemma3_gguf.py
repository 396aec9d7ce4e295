"""Write a Gemma 3 checkpoint with images as llama.cpp's ``convert_hf_to_gguf.py`` does: a text GGUF
(``gemma3``, ``--outtype f32``) and, with ``--mmproj``, the vision projector (``f32`` or ``f16``).

What the converter does, and this writer repeats (``Gemma3Model``, ``Gemma3VisionModel`` and their
``TextModel`` / ``MmprojModel`` bases):

- text: ``language_model.`` dropped from the names, which gguf-py's table maps; the tower's and
  projector's tensors skipped; every ``*norm.weight`` stored as ``1 + w``; no sliding-window
  pattern (llama.cpp's is one global layer in six); the global layers' RoPE base;
- projector (``general.architecture`` ``clip``): ``clip.vision.*`` hyper-parameters, the
  preprocessor's mean and std, ``clip.vision.projector.scale_factor`` where the pooling kernel is
  not 4, ``mm_input_projection_weight`` renamed ``mm.input_projection.weight`` and always f16, the
  embeddings always f32, ``mm.soft_emb_norm.weight`` as ``1 + w``; with f16, the other tensors of
  two or more dimensions f16, the rest f32.

The tokenizer is a SentencePiece-style vocabulary (``tokenizer.ggml.model`` ``llama``, as Gemma 3
files have) over the checkpoint's ids: its specials where the word-level tokenizer has them, and
``▁t2 .. ▁t289`` with ids 270..282 holding ``▁``, ``t``, ``▁t`` and the digits, from which Gemma's
merges rebuild the words (``" t5"`` -> ``▁t5``), 283..286 runs of one to four newlines (the blank
lines Gemma 3 puts around an image) and 287 ``<unk>``. fw's prompt ids differ from the word-level
tokenizer's (a space before a special token is a ``▁`` of its own): tests hand fw's ids to
transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

#: ids that hold the pieces the words are merged from, and newline runs, instead of words
_CHARACTERS = {270 + i: c for i, c in enumerate(["▁", "t", "▁t", *"0123456789", "\n", "\n\n", "\n\n\n", "\n\n\n\n"])}
_UNK = 287


def _vocabulary(config: dict) -> tuple[list[str], list[int]]:
    """Tokens and token types (see the module docstring) of ``config``'s vocabulary size."""
    specials = {
        config["boi_token_index"]: "<start_of_image>",
        config["eoi_token_index"]: "<end_of_image>",
        config["image_token_index"]: "<image_soft_token>",
        290: "<start_of_turn>",
        291: "<end_of_turn>",
        0: "<s>",
        1: "</s>",
        _UNK: "<unk>",
    }
    words = [f"▁t{i}" if i < 295 else f"<unused{i}>" for i in range(config["text_config"]["vocab_size"])]
    tokens = [specials.get(i, _CHARACTERS.get(i, word)) for i, word in enumerate(words)]
    return tokens, [2 if i == _UNK else 3 if i in specials else 1 for i in range(len(tokens))]


def write_text_gguf(hf_dir: Path, path: Path, matrix_type: Q = Q.F32) -> Path:
    """The text GGUF of the Gemma 3 checkpoint in ``hf_dir``: weight matrices as ``matrix_type``
    (``llama-quantize``'s job after the converter), norms f32."""
    config = json.loads((hf_dir / "config.json").read_text())
    text = config["text_config"]
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    writer.add_key_length(text["head_dim"])
    writer.add_value_length(text["head_dim"])
    writer.add_rope_freq_base(float(text["rope_parameters"]["full_attention"]["rope_theta"]))
    writer.add_sliding_window(text["sliding_window"])
    tokens, types = _vocabulary(config)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(types)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(1)
    writer.add_unk_token_id(_UNK)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, text["num_hidden_layers"])
    for name, tensor in sorted(load_file(hf_dir / "model.safetensors").items()):
        name = name.replace("language_model.", "")
        if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.")) or "projector" in name:
            continue  # the projector's
        if name == "lm_head.weight":
            continue  # tied to the embedding
        base, suffix = name.rsplit(".", 1)
        values = (tensor.float() + (1.0 if name.endswith("norm.weight") else 0.0)).numpy()
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if tensor.dim() == 2 and matrix_type != Q.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(values, matrix_type), raw_dtype=matrix_type)
        else:
            writer.add_tensor(gguf_name, values)
    _finish(writer)
    return path


def write_mmproj(hf_dir: Path, path: Path, outtype: Q = Q.F32) -> Path:
    """The vision projector of the Gemma 3 checkpoint in ``hf_dir`` (``outtype`` F32 or F16)."""
    config = json.loads((hf_dir / "config.json").read_text())
    vision = config["vision_config"]
    preprocessor = json.loads((hf_dir / "preprocessor_config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if outtype == Q.F32 else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(config["text_config"]["hidden_size"])
    writer.add_vision_image_size(vision["image_size"])
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["num_hidden_layers"])
    writer.add_vision_head_count(vision["num_attention_heads"])
    writer.add_vision_image_mean(preprocessor["image_mean"])
    writer.add_vision_image_std(preprocessor["image_std"])
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-6))
    writer.add_vision_use_gelu(True)
    # released preprocessor configs state image_seq_length (256); this tiny one does not: the model config's count
    per_side = int(preprocessor.get("image_seq_length", config["mm_tokens_per_image"]) ** 0.5)
    scale = vision["image_size"] // vision["patch_size"] // per_side
    if scale > 0 and scale != 4:
        writer.add_vision_projector_scale_factor(scale)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    for name, tensor in sorted(load_file(hf_dir / "model.safetensors").items()):
        name = name.removeprefix("model.")
        if not name.startswith(("vision_tower.", "multi_modal_projector.")) or ".head." in name:
            continue
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = name.replace("vision_tower.", "vision_tower.vision_model.", 1)  # transformers 5 drops it
        name = name.replace("_weight", ".weight")
        base, suffix = name.rsplit(".", 1)
        values = tensor.float() + (1.0 if "soft_emb_norm.weight" in name else 0.0)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", _stored(name, values, outtype))
    _finish(writer)
    return path


def _stored(name: str, values: torch.Tensor, outtype: Q) -> np.ndarray:
    """``tensor_force_quant`` and ``prepare_tensors``' choice of a tensor's type."""
    if "input_projection" in name:
        return values.numpy().astype(np.float16)
    if ".embeddings." in name or values.dim() < 2 or name.endswith("_norm.weight") or outtype == Q.F32:
        return values.numpy().astype(np.float32)
    return values.numpy().astype(np.float16)


def rounded_reference(reference, outtype: str):
    """``reference`` with its tower and projector as the ``outtype`` projector holds them: the input
    projection f16 always, with F16 also the tower's matrices (not its embeddings)."""
    import copy

    rounded = copy.deepcopy(reference)
    with torch.no_grad():
        rounded.model.multi_modal_projector.mm_input_projection_weight.copy_(
            reference.model.multi_modal_projector.mm_input_projection_weight.half().float()
        )
        if outtype == "F16":
            for name, param in rounded.model.vision_tower.named_parameters():
                if param.dim() >= 2 and ".embeddings." not in f".{name}":
                    param.copy_(param.half().float())
    return rounded


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
