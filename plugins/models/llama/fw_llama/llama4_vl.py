"""Llama 4 with images (``Llama4ForConditionalGeneration``: Scout / Maverick as released): the
vision model (:mod:`fw_llama.llama4_vision`), the projector ``multi_modal_projector.linear_1``
(no bias) and the Llama 4 text model (:mod:`fw_llama.llama4`).

The multimodal contract is :mod:`framework.engine.multimodal_step`'s, with layout tokens and a
placeholder of its own: the chat template writes ``<|image|>`` once per image; the span
(:mod:`fw_llama.llama4_processor`) holds ``<|patch|>`` tokens, one per embedding (the image token:
``image_token_index``), laid out with ``<|image_start|>``, the tile separators, ``<|image|>`` before
the global thumbnail's patches and ``<|image_end|>``, which keep their token embeddings. An
image's embeddings are its tiles' in order (row-major, then the thumbnail). Positions are 1-D.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from framework.config import ModelConfig
from framework.errors import ConfigError
from framework.loader.checkpoint_slice import materialize
from framework.multimodal.inputs import VisionSpec
from framework.multimodal.model import VisionLanguageModel
from framework.quantization import QuantConfig
from fw_llama.llama4 import Llama4ForCausalLM
from fw_llama.llama4_processor import DEFAULTS, Llama4ImageProcessor, processor_settings
from fw_llama.llama4_vision import Llama4VisionModel

#: where transformers 4 and 5 keep the text model's tensors -> this module's names
TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
#: the vision model's and projector's tensors, loaded whole (both spellings)
VISION_PREFIXES = (
    ("model.vision_model.", "vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("vision_model.", "vision_model."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


def token_ids(config: ModelConfig) -> dict[str, int]:
    """The span's token ids: the config's ``boi_token_index``, ``eoi_token_index`` and
    ``image_token_index`` (``<|patch|>``); the tile separators and ``<|image|>`` from keys the
    released configs do not write (``tile_x_separator_token_id``, ``tile_y_separator_token_id``,
    ``image_placeholder_token_id``), else Llama 4's tokenizer ids."""
    named = {
        "image_start_token_id": "boi_token_index",
        "image_end_token_id": "eoi_token_index",
        "patch_token_id": "image_token_index",
    }
    ids = {}
    for key in DEFAULTS:
        if key.endswith("_token_id"):
            value = config.hf_config.get(named.get(key, key))
            ids[key] = int(DEFAULTS[key] if value is None else value)
    return ids


class Llama4ForConditionalGeneration(VisionLanguageModel, Llama4ForCausalLM):
    """``vision_model.*``, ``multi_modal_projector.*``, ``language_model.model.*`` and
    ``language_model.lm_head.*`` (or transformers 5's ``model.``-prefixed spelling)."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__(config, quant_config, prefix)
        vision = config.hf_config.get("vision_config") or {}
        self.vision_model = Llama4VisionModel(vision)
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear_1 = nn.Linear(
            int(vision.get("vision_output_dim", 7680)), config.hidden_size, bias=False
        )
        self.layout = Llama4ImageProcessor(self.processor_config(config, {}))
        self.image_token_id = self.layout.ids["patch_token_id"]

    @staticmethod
    def processor_config(config: ModelConfig, preprocessor_config: dict[str, Any]) -> dict[str, Any]:
        """The processor's settings: the checkpoint's, the tower's patch and shuffle, the span's ids."""
        settings = processor_settings(preprocessor_config)
        vision = config.hf_config.get("vision_config") or {}
        tile = int(vision.get("image_size", settings["tile_size"]))
        if preprocessor_config.get("size") and settings["tile_size"] != tile:
            raise ConfigError(
                f"preprocessor_config.json's tiles of {settings['tile_size']} pixels do not match the vision "
                f"model's image_size {tile} (its positional embeddings are learned for one tile size)"
            )
        settings.update(
            tile_size=tile,
            patch_size=int(vision.get("patch_size", settings["patch_size"])),
            pixel_shuffle_ratio=float(vision.get("pixel_shuffle_ratio", settings["pixel_shuffle_ratio"])),
            **token_ids(config),
        )
        return settings

    @classmethod
    def vision_spec(cls, config: ModelConfig, preprocessor_config: dict[str, Any]) -> VisionSpec:
        settings = cls.processor_config(config, preprocessor_config)
        layout = [
            settings[key]
            for key in (
                "image_start_token_id",
                "tile_x_separator_token_id",
                "tile_y_separator_token_id",
                "image_placeholder_token_id",
                "image_end_token_id",
            )
        ]
        return VisionSpec(
            processor="fw_llama.llama4_processor:Llama4ImageProcessor",
            processor_config=settings,
            image_token_id=settings["patch_token_id"],
            layout_token_ids=layout,
            placeholder_token_id=settings["image_placeholder_token_id"],
        )

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, tuple | None]:
        """The text model's names onto :class:`Llama4ForCausalLM`'s (experts stacked as there); the
        vision model's and projector's tensors load whole."""
        for old, new in VISION_PREFIXES:
            if name.startswith(old):
                return new + name.removeprefix(old), ()
        for old, new in TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        return Llama4ForCausalLM.map_weight_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def whole_vision_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                is_vision = any(name.startswith(old) for old, _ in VISION_PREFIXES)
                yield name, (materialize(tensor) if is_vision else tensor)

        return super().load_weights(whole_vision_tensors())

    def image_span_ids(self, grid: list[int]) -> list[int]:
        """``grid`` ``[rows, cols]`` in tiles: the processor's span (its module docstring)."""
        return self.layout.span_ids(*grid)

    def embed_image(self, pixel_values: torch.Tensor, grid: list[int]) -> torch.Tensor:
        """``[tiles * n, hidden]``: one image's ``[tiles, 3, S, S]`` (its canvas's tiles, then the
        thumbnail when there are several) through the vision model and the projector."""
        rows, cols = grid
        num_tiles = rows * cols + (rows * cols > 1)
        size = self.vision_model.image_size
        if list(pixel_values.shape) != [num_tiles, 3, size, size]:
            raise ConfigError(
                f"pixels of shape {list(pixel_values.shape)} are not the {num_tiles} tiles of {size} pixels "
                f"of the canvas {grid}"
            )
        features = self.vision_model(pixel_values)  # [tiles, n, projector_output_dim]
        return self.multi_modal_projector.linear_1(features.flatten(0, 1))
