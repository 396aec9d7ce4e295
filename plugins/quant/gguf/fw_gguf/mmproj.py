"""llama.cpp vision projectors (``mmproj*.gguf``) as the vision towers of fw's Qwen-VL and Gemma 3 models.

llama.cpp ships a vision model's tower apart from its text GGUF: a file of architecture ``clip``
with ``clip.*`` metadata and ``v.*`` / ``mm.*`` tensors, written by ``convert_hf_to_gguf.py
--mmproj``. :class:`Projector` reads one back as the checkpoint the text GGUF lacks: the
``vision_config`` of fw's tower (:meth:`Projector.vision_config`), the image processor's settings
(:meth:`Projector.preprocessor_config`) and the tower's tensors under its Hugging Face names
(:meth:`Projector.iter_weights`), undoing what the converter changed::

    v.patch_embd.weight, v.patch_embd.weight.1   [out, C, P, P] x 2  ->  patch_embed.proj.weight [out, C, 2, P, P]
    v.blk.N.attn_q / attn_k / attn_v (2.5-VL)    split qkv            ->  blocks.N.attn.qkv (rows q | k | v)
    v.blk.N.attn_qkv (3-VL)                                           ->  blocks.N.attn.qkv
    v.deepstack.I.*  (I: the ViT block)                               ->  deepstack_merger_list.J.*  (J: its rank)

Gemma 3's SigLIP tower and projector (``gemma3``) are :mod:`fw_gguf.mmproj_gemma3`'s. Every tensor is dequantized to float32 (fw's towers hold plain weights). The projector types read
are :data:`PROJECTORS`; :func:`find_projector` picks the file beside a model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from framework.loader.gguf_names import pick_projector

from .mmproj_gemma3 import (
    GEMMA3_TOKENS,
    SHIFTED,
    gemma3_hf_config,
    gemma3_preprocessor_config,
    gemma3_vision_config,
    gemma3_weight_name,
)
from .reader import GGUFFile, open_gguf

#: ``clip.projector_type`` -> {text GGUF architecture it goes with: the HF architecture of the two}
PROJECTORS = {
    "qwen2.5vl_merger": {"qwen2vl": "Qwen2_5_VLForConditionalGeneration"},
    "qwen3vl_merger": {
        "qwen3vl": "Qwen3VLForConditionalGeneration",
        "qwen3vlmoe": "Qwen3VLMoeForConditionalGeneration",
    },
    "gemma3": {"gemma3": "Gemma3ForConditionalGeneration"},
}
#: text GGUF architectures whose model takes images through a projector
VISION_TEXT_ARCHITECTURES = {
    text: architecture for texts in PROJECTORS.values() for text, architecture in texts.items()
}

#: The released checkpoints' pixel bounds (``preprocessor_config.json``), for a file that states none.
_PIXEL_BOUNDS = {
    "qwen2.5vl_merger": (56 * 56, 28 * 28 * 16384),
    "qwen3vl_merger": (256 * 256, 4096 * 4096),
}

_TOWER_NAMES = {  # per block, GGUF -> fw's tower (``visual.blocks.N.`` prefix)
    "qwen2.5vl_merger": {
        "attn_out": "attn.proj",
        "ln1": "norm1",
        "ln2": "norm2",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
    "qwen3vl_merger": {
        "attn_out": "attn.proj",
        "ln1": "norm1",
        "ln2": "norm2",
        "ffn_up": "mlp.linear_fc1",
        "ffn_down": "mlp.linear_fc2",
    },
}
_MERGER_NAMES = {  # GGUF -> fw's tower, outside the blocks
    "qwen2.5vl_merger": {"v.post_ln": "merger.ln_q", "mm.0": "merger.mlp.0", "mm.2": "merger.mlp.2"},
    "qwen3vl_merger": {
        "v.post_ln": "merger.norm",
        "mm.0": "merger.linear_fc1",
        "mm.2": "merger.linear_fc2",
        "v.position_embd": "pos_embed",
        "v.patch_embd": "patch_embed.proj",  # its bias; the weight is joined from its two frames
    },
}
_DEEPSTACK_NAMES = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}


class ProjectorError(ValueError):
    """An mmproj file fw cannot use as a vision tower (the message names the file and what is valid)."""


def find_projector(model_file: Path) -> Path | None:
    """The ``mmproj*.gguf`` beside ``model_file`` (the first shard of a split), or None; of several
    (a repo's F16, BF16 and F32 exports), the one :func:`~framework.loader.gguf_names.pick_projector` prefers."""
    names = [p.name for p in model_file.parent.glob("*.gguf") if p.is_file()]
    picked = pick_projector(names, model_file.name)
    return None if picked is None else model_file.parent / picked


class Projector:
    """One opened mmproj file (see the module docstring); raises :class:`ProjectorError` for a file
    that is no vision projector, or one of a type fw's towers do not take."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.file: GGUFFile = open_gguf(self.path)
        md = self.file.metadata
        if md.get("general.architecture") != "clip" or not md.get("clip.has_vision_encoder", False):
            raise ProjectorError(
                f"{self.path}: not a llama.cpp vision projector (general.architecture "
                f"{md.get('general.architecture')!r}, clip.has_vision_encoder {md.get('clip.has_vision_encoder')})"
            )
        self.projector_type = md.get("clip.vision.projector_type") or md.get("clip.projector_type")
        if self.projector_type not in PROJECTORS:
            raise ProjectorError(
                f"{self.path}: vision projector type {self.projector_type!r} is not supported; "
                f"supported: {', '.join(PROJECTORS)}"
            )
        self.text_architectures = PROJECTORS[self.projector_type]
        self.tensors = self.file.tensors

    def _key(self, name: str, default: Any = KeyError) -> Any:
        value = self.file.metadata.get(f"clip.vision.{name}", default)
        if value is KeyError:
            raise ProjectorError(f"{self.path}: metadata lacks clip.vision.{name}, which a vision projector needs")
        return value

    def _patch_frames(self) -> list[str]:
        names = ["v.patch_embd.weight"] + [f"v.patch_embd.weight.{i}" for i in range(1, 8)]
        frames = [name for name in names if name in self.tensors]
        if not frames:
            raise ProjectorError(f"{self.path}: no v.patch_embd.weight tensor")
        return frames

    def vision_config(self) -> dict[str, Any]:
        """The ``vision_config`` (transformers' keys) of the tower this file holds."""
        if self.projector_type == "gemma3":
            return gemma3_vision_config(self._key, int(self.tensors[self._patch_frames()[0]].shape[1]))
        depth = int(self._key("block_count"))
        patch = self.tensors[self._patch_frames()[0]]
        config: dict[str, Any] = {
            "depth": depth,
            "hidden_size": int(self._key("embedding_length")),
            "intermediate_size": int(self._key("feed_forward_length")),
            "num_heads": int(self._key("attention.head_count")),
            "out_hidden_size": int(self._key("projection_dim")),
            "patch_size": int(self._key("patch_size")),
            "spatial_merge_size": int(self._key("spatial_merge_size", 2)),
            "temporal_patch_size": len(self._patch_frames()),
            "in_channels": int(patch.shape[1]),
        }
        if self.projector_type == "qwen2.5vl_merger":
            pattern = int(self._key("n_wa_pattern"))  # every pattern-th block attends over the whole image
            config["fullatt_block_indexes"] = [i for i in range(depth) if (i + 1) % pattern == 0]
            config["window_size"] = int(self._key("window_size", 112))  # llama.cpp's, and transformers', default
            config["hidden_act"] = "silu"
        else:
            deepstack = self._key("is_deepstack_layers", [])
            config["deepstack_visual_indexes"] = [i for i, flag in enumerate(deepstack) if flag]
            config["num_position_embeddings"] = int(self.tensors["v.position_embd.weight"].shape[0])
            config["hidden_act"] = "gelu_pytorch_tanh"  # llama.cpp's GELU is the tanh approximation
        return config

    def preprocessor_config(self) -> dict[str, Any]:
        """The image processor's settings. Qwen-VL (:mod:`fw_llama.qwen2_vl_processor` keys): the
        file's mean, std, patch and merge sizes, and its pixel bounds where it states them (else
        the released checkpoints'); Gemma 3: :func:`~fw_gguf.mmproj_gemma3.gemma3_preprocessor_config`."""
        if self.projector_type == "gemma3":
            return gemma3_preprocessor_config(self._key)
        min_pixels, max_pixels = _PIXEL_BOUNDS[self.projector_type]
        return {
            "image_mean": [float(x) for x in self._key("image_mean")],
            "image_std": [float(x) for x in self._key("image_std")],
            "patch_size": int(self._key("patch_size")),
            "merge_size": int(self._key("spatial_merge_size", 2)),
            "temporal_patch_size": len(self._patch_frames()),
            "min_pixels": int(self._key("image_min_pixels", min_pixels)),
            "max_pixels": int(self._key("image_max_pixels", max_pixels)),
        }

    def num_weights(self) -> int:
        return sum(1 for _ in self._names())

    def _names(self) -> Iterator[tuple[str, list[str]]]:
        """``(fw name, [GGUF tensors joined into it])`` for every tensor of the tower."""
        if self.projector_type == "gemma3":
            yield from self._gemma3_names()
            return
        frames = self._patch_frames()
        yield "visual.patch_embed.proj.weight", frames
        blocks, merger = _TOWER_NAMES[self.projector_type], _MERGER_NAMES[self.projector_type]
        deepstack = self.vision_config().get("deepstack_visual_indexes", [])
        for name in self.tensors:
            if name in frames:
                continue
            base, _, suffix = name.rpartition(".")
            parts = base.split(".")
            if base in merger:
                yield f"visual.{merger[base]}.{suffix}", [name]
            elif parts[:2] == ["v", "blk"] and parts[3] in ("attn_q", "attn_qkv"):
                joined = (
                    [name]
                    if parts[3] == "attn_qkv"
                    else [name, *(name.replace("attn_q", x) for x in ("attn_k", "attn_v"))]
                )
                yield f"visual.blocks.{parts[2]}.attn.qkv.{suffix}", joined
            elif parts[:2] == ["v", "blk"] and parts[3] in ("attn_k", "attn_v"):
                continue  # joined into qkv with attn_q
            elif parts[:2] == ["v", "blk"] and parts[3] in blocks:
                yield f"visual.blocks.{parts[2]}.{blocks[parts[3]]}.{suffix}", [name]
            elif parts[:2] == ["v", "deepstack"] and parts[3] in _DEEPSTACK_NAMES and int(parts[2]) in deepstack:
                rank = deepstack.index(int(parts[2]))
                yield f"visual.deepstack_merger_list.{rank}.{_DEEPSTACK_NAMES[parts[3]]}.{suffix}", [name]
            else:
                raise ProjectorError(
                    f"{self.path}: tensor {name!r} has no place in the {self.projector_type} tower fw builds"
                )

    def _gemma3_names(self) -> Iterator[tuple[str, list[str]]]:
        for name in self.tensors:
            fw_name = gemma3_weight_name(name)
            if fw_name is None:
                raise ProjectorError(f"{self.path}: tensor {name!r} has no place in the gemma3 tower fw builds")
            yield fw_name, [name]

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(fw tower name, float32 tensor)`` for every tensor of the tower (see the module docstring)."""
        for hf_name, sources in self._names():
            values = [self.tensors[name].dequantize(torch.float32) for name in sources]
            if hf_name == "visual.patch_embed.proj.weight":
                yield hf_name, torch.stack(values, dim=2)  # the converter's per-frame Conv2Ds back into one Conv3D
            elif hf_name in SHIFTED:
                yield hf_name, values[0] - 1.0  # the converter stored Gemma's 1 + w
            else:
                yield hf_name, values[0] if len(values) == 1 else torch.cat(values, dim=0)


#: the Qwen-VL tokens the HF config names by id (llama.cpp's text GGUF keeps them only as tokens)
_VISION_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
_MODEL_TYPES = {
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
}


def vision_hf_config(text: dict[str, Any], metadata: dict[str, Any], projector: Projector) -> dict[str, Any]:
    """The vision model's HF config: the text GGUF's ``text`` config (``hf_config_from_gguf``) with
    the projector's ``vision_config``, the M-RoPE sections (``{arch}.rope.dimension_sections``) and
    the ids of the image tokens, looked up in the vocabulary (Gemma 3:
    :func:`~fw_gguf.mmproj_gemma3.gemma3_hf_config`). Raises :class:`ProjectorError` for a
    projector of another family, or a vocabulary without the image tokens."""
    arch = metadata["general.architecture"]
    if arch not in projector.text_architectures:
        raise ProjectorError(
            f"{projector.path}: a {projector.projector_type} projector goes with a "
            f"{' or '.join(projector.text_architectures)} text GGUF; this model is {arch}"
        )
    architecture = projector.text_architectures[arch]
    if projector.projector_type == "gemma3":
        return gemma3_hf_config(text, projector.vision_config(), projector._key, _token_ids(metadata, GEMMA3_TOKENS))
    vision = projector.vision_config()
    deepstack = metadata.get(f"{arch}.n_deepstack_layers")
    if deepstack is not None and int(deepstack) != len(vision.get("deepstack_visual_indexes", [])):
        raise ProjectorError(
            f"{projector.path}: its {len(vision['deepstack_visual_indexes'])} DeepStack layers do not match the "
            f"text model's {arch}.n_deepstack_layers = {deepstack}"
        )
    ids = _token_ids(metadata, {"image_token_id": _VISION_TOKENS["image_token_id"]}, _VISION_TOKENS)
    config = dict(text)
    config.update(
        architectures=[architecture],
        model_type=_MODEL_TYPES[architecture],
        vision_config=vision,
        **{key: ids[token] for key, token in _VISION_TOKENS.items() if token in ids},
    )
    sections = [int(s) for s in metadata.get(f"{arch}.rope.dimension_sections") or ()][:3]
    if sections:
        config["rope_scaling"] = {"rope_type": "default", "mrope_section": sections}
    return config


def _token_ids(
    metadata: dict[str, Any], required: dict[str, str], optional: dict[str, str] | None = None
) -> dict[str, int]:
    """token -> id in the text GGUF's vocabulary for the ``required`` and ``optional`` tokens
    (config key -> token); raises :class:`ProjectorError` naming a required token it lacks."""
    wanted = set(required.values()) | set((optional or {}).values())
    ids = {token: i for i, token in enumerate(metadata.get("tokenizer.ggml.tokens") or ()) if token in wanted}
    missing = [token for token in required.values() if token not in ids]
    if missing:
        raise ProjectorError(f"the text GGUF's vocabulary has no {', '.join(missing)} token to place images")
    return ids
