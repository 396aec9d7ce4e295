"""Mistral 3 (``Mistral3ForConditionalGeneration``: Mistral Small 3.1 / 3.2): the Pixtral tower
(``pixtral_vision``), a projector that merges each 2 x 2 block of patches, and the Mistral decoder.

The multimodal contract is :mod:`framework.engine.multimodal_step`'s, with layout tokens: an
image's span is rows of image tokens, each row ended by ``[IMG_BREAK]`` and the last by
``[IMG_END]`` (:mod:`fw_llama.pixtral_processor`); ``embed_image`` gives one row per image token
and the break and end tokens keep their token embeddings. Positions are plain 1-D RoPE.

The projector, for an image of ``h x w`` patches of width ``d`` (``m`` = ``spatial_merge_size``)::

    RMSNorm -> [h, w, d] -> unfold(m, stride m): each block's features channel-major
               [d0@(0,0) d0@(0,1) d0@(1,0) d0@(1,1) d1@(0,0) ...], blocks row-major
            -> merging_layer (d*m*m -> d) -> linear_1 -> act -> linear_2      [h/m * w/m, hidden]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.config import ModelConfig
from framework.errors import ConfigError
from framework.layers import RMSNorm
from framework.layers.causal_lm import CausalLM
from framework.multimodal.inputs import VisionSpec
from framework.multimodal.model import VisionLanguageModel
from framework.quantization import QuantConfig
from fw_llama.model import LlamaModel
from fw_llama.pixtral_processor import DEFAULTS, processor_settings
from fw_llama.pixtral_vision import PixtralVisionTransformer, activation

#: the decoder architecture of each ``text_config.model_type`` this class serves
TEXT_ARCHITECTURES = {"mistral": "MistralForCausalLM", "llama": "LlamaForCausalLM"}


def layout_ids(config: ModelConfig) -> tuple[int, int]:
    """``(break, end)`` token ids: the config's ``image_break_token_id`` / ``image_end_token_id``,
    else those of Mistral 3's tokenizer (12, 13; the config does not name them)."""
    return (
        int(config.get("image_break_token_id", DEFAULTS["image_break_token_id"])),
        int(config.get("image_end_token_id", DEFAULTS["image_end_token_id"])),
    )


def text_config(config: ModelConfig) -> ModelConfig:
    """The decoder's config: ``text_config`` over the top level (whose ``tie_word_embeddings`` wins)."""
    hf = dict(config.hf_config)
    text = dict(hf.pop("text_config", None) or {})
    model_type = text.get("model_type", "mistral")
    if model_type not in TEXT_ARCHITECTURES:
        raise ConfigError(
            f"Mistral 3 with a {model_type!r} text model is not supported; supported: {', '.join(TEXT_ARCHITECTURES)}"
        )
    hf.update(text)
    if "tie_word_embeddings" in config.hf_config:
        hf["tie_word_embeddings"] = config.hf_config["tie_word_embeddings"]
    return dataclasses.replace(config, hf_config=hf, architecture=TEXT_ARCHITECTURES[model_type])


class Mistral3Projector(nn.Module):
    """The module docstring's projector (transformers' ``Mistral3MultiModalProjector``)."""

    def __init__(self, dim: int, hidden: int, merge: int, eps: float, act: str, bias: bool) -> None:
        super().__init__()
        self.merge = merge
        self.norm = RMSNorm(dim, eps)
        self.patch_merger = nn.Module()
        self.patch_merger.merging_layer = nn.Linear(dim * merge * merge, dim, bias=False)
        self.linear_1, self.linear_2 = nn.Linear(dim, hidden, bias=bias), nn.Linear(hidden, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, features: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        x = self.norm(features)
        grid = x.view(rows, cols, -1).permute(2, 0, 1)[None]  # [1, d, h, w]
        blocks = F.unfold(grid, kernel_size=self.merge, stride=self.merge)[0].t()  # [h/m * w/m, d * m * m]
        return self.linear_2(self.act(self.linear_1(self.patch_merger.merging_layer(blocks))))


class Mistral3ForConditionalGeneration(VisionLanguageModel, CausalLM):
    """``Mistral3ForConditionalGeneration`` checkpoints: ``model.vision_tower.*``,
    ``model.multi_modal_projector.*``, ``model.language_model.*`` and ``lm_head`` (transformers
    5), or the older ``vision_tower.*``, ``multi_modal_projector.*``, ``language_model.model.*``
    and ``language_model.lm_head``."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        text = text_config(config)
        vision = config.hf_config.get("vision_config") or {}
        layer = config.get("vision_feature_layer", -1)
        depth = int(vision.get("num_hidden_layers", 24))
        if not isinstance(layer, int) or not -depth - 1 <= layer <= depth:
            raise ConfigError(
                f"vision_feature_layer {layer!r}: one layer index in [{-depth - 1}, {depth}] is supported"
            )
        self.num_vision_layers = layer if layer >= 0 else depth + 1 + layer
        self.vision_tower = PixtralVisionTransformer(vision)
        self.merge = int(config.get("spatial_merge_size", 2))
        self.multi_modal_projector = Mistral3Projector(
            int(vision.get("hidden_size", 1024)),
            text.hidden_size,
            self.merge,
            float(text.get("rms_norm_eps", 1e-5)),
            config.get("projector_hidden_act", "gelu"),
            bool(config.get("multimodal_projector_bias", False)),
        )
        self.model = LlamaModel(text, quant_config, "model")
        self.init_lm_head(text, quant_config, tie_by_default=False)
        self.image_token_id = int(config.get("image_token_index", config.get("image_token_id", 10)))
        self.break_token_id, self.end_token_id = layout_ids(config)

    @classmethod
    def vision_spec(cls, config: ModelConfig, preprocessor_config: dict[str, Any]) -> VisionSpec:
        settings = processor_settings(preprocessor_config)
        vision = config.hf_config.get("vision_config") or {}
        settings["patch_size"] = int(vision.get("patch_size", settings["patch_size"]))
        settings["merge_size"] = int(config.get("spatial_merge_size", 2))
        image_token_id = int(config.get("image_token_index", config.get("image_token_id", 10)))
        breaks, end = layout_ids(config)
        settings.update(image_token_id=image_token_id, image_break_token_id=breaks, image_end_token_id=end)
        return VisionSpec(
            processor="fw_llama.pixtral_processor:PixtralImageProcessor",
            processor_config=settings,
            image_token_id=image_token_id,
            layout_token_ids=[breaks, end],
        )

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, tuple | None]:
        """Both checkpoint layouts onto this module's names; the tower's and projector's tensors load whole."""
        for old, new in (
            ("model.language_model.", "model."),
            ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."),
            ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
        ):
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        return name, (() if name.startswith(("vision_tower.", "multi_modal_projector.")) else None)

    def image_span_ids(self, grid: list[int]) -> list[int]:
        """``grid`` ``[h, w]`` in patches: ``h/m`` rows of ``w/m`` image tokens, each ended by the break
        token, the last by the end token."""
        rows, cols = grid[0] // self.merge, grid[1] // self.merge
        ids = ([self.image_token_id] * cols + [self.break_token_id]) * rows
        ids[-1] = self.end_token_id
        return ids

    def embed_image(self, pixel_values: torch.Tensor, grid: list[int]) -> torch.Tensor:
        """``[h/m * w/m, hidden]``: one ``[3, H, W]`` image through the tower and the projector."""
        rows, cols = grid
        if (
            rows % self.merge
            or cols % self.merge
            or list(pixel_values.shape[1:])
            != [
                rows * self.vision_tower.patch_size,
                cols * self.vision_tower.patch_size,
            ]
        ):
            raise ConfigError(f"pixels of shape {list(pixel_values.shape)} do not make the patch grid {grid}")
        features = self.vision_tower(pixel_values, self.num_vision_layers)
        return self.multi_modal_projector(features, rows, cols)
