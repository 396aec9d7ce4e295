"""Gemma 3 with images (``Gemma3ForConditionalGeneration``: Gemma 3 4B / 12B / 27B): the SigLIP
tower (``siglip_vision``), the multi-modal projector, and the Gemma 3 decoder of ``model.py``.

The multimodal contract is :mod:`framework.engine.multimodal_step`'s. The chat template writes
``<start_of_image>`` per image (``VisionSpec.placeholder_token_id``); its span is that token,
``mm_tokens_per_image`` image tokens and ``<end_of_image>`` (:mod:`fw_gemma.gemma3_processor`),
the two layout tokens keeping their token embeddings; a blank line each side of it goes into
the prompt text before tokenizing (``VisionSpec.text_around_placeholder``). The image tokens of
one image attend to each other (``bidirectional_image_attention``: transformers'
``token_type_ids`` mask), text stays causal; positions are plain 1-D RoPE.

The projector, for a tower of ``P x P`` patches of width ``d`` and ``n x n = mm_tokens_per_image``::

    [P*P, d] -> [d, P, P] -> avg-pool (P/n x P/n, stride P/n) -> [n*n, d]
             -> RMSNorm (1 + w) -> @ mm_input_projection_weight [d, hidden]   -> [n*n, hidden]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.config import ModelConfig
from framework.errors import ConfigError
from framework.layers import RMSNorm
from framework.loader.model_loader import load_parameters
from framework.loader.text_only import text_model_name
from framework.multimodal.inputs import VisionSpec
from framework.multimodal.model import VisionLanguageModel
from framework.quantization import QuantConfig

from .gemma3_processor import BLANK_LINES, processor_settings, span_ids
from .model import GemmaForCausalLM
from .siglip_vision import SiglipVisionTransformer

#: checkpoint prefixes of the tower and the projector (files of transformers 4, and transformers
#: 5's state dicts, whose tower has no ``vision_model.``) -> this module's; longest first
VISION_PREFIXES = {
    "model.vision_tower.vision_model.": "vision_tower.",
    "vision_tower.vision_model.": "vision_tower.",
    "model.vision_tower.": "vision_tower.",
    "vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}
#: SigLIP's attention-pooling head: saved by some checkpoints, never used by Gemma 3
UNUSED_PREFIX = "vision_tower.head."


class Gemma3Projector(nn.Module):
    """The module docstring's projector (transformers' ``Gemma3MultiModalProjector``)."""

    def __init__(self, vision_dim: int, hidden: int, patches_per_side: int, num_tokens: int, eps: float) -> None:
        super().__init__()
        side = math.isqrt(num_tokens)
        if side * side != num_tokens or patches_per_side % side:
            raise ConfigError(
                f"mm_tokens_per_image {num_tokens} must be a square n*n whose side divides the tower's "
                f"{patches_per_side} patches per side"
            )
        self.patches_per_side, self.kernel = patches_per_side, patches_per_side // side
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision_dim, hidden), requires_grad=False)
        self.mm_soft_emb_norm = RMSNorm(vision_dim, eps, offset=1.0)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        side = self.patches_per_side
        grid = features.t().reshape(1, -1, side, side)  # [1, d, P, P]
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2)[0].t()  # [n*n, d], row-major
        return self.mm_soft_emb_norm(pooled.contiguous()) @ self.mm_input_projection_weight


def vision_settings(config: ModelConfig, preprocessor_config: dict[str, Any]) -> dict[str, Any]:
    """The processor's settings: the checkpoint's preprocessing, the tower's image and patch size
    and the model config's token ids and image token count."""
    try:
        settings = processor_settings(preprocessor_config)
    except ValueError as error:
        raise ConfigError(f"preprocessor_config.json: {error}") from None
    vision = config.hf_config.get("vision_config") or {}
    for key in ("image_size", "patch_size"):
        if key in vision:
            settings[key] = int(vision[key])
    for key, names in (
        ("image_token_id", ("image_token_index", "image_token_id")),
        ("boi_token_id", ("boi_token_index", "boi_token_id")),
        ("eoi_token_id", ("eoi_token_index", "eoi_token_id")),
        ("mm_tokens_per_image", ("mm_tokens_per_image",)),
    ):
        found = [config.hf_config[name] for name in names if config.hf_config.get(name) is not None]
        if found:
            settings[key] = int(found[0])
    return settings


class Gemma3ForConditionalGeneration(VisionLanguageModel, GemmaForCausalLM):
    """``Gemma3ForConditionalGeneration`` checkpoints: ``vision_tower.vision_model.*``,
    ``multi_modal_projector.*`` and ``language_model.model.*`` (transformers 4), or the same under
    ``model.`` with ``model.language_model.*`` (transformers 5); ``forward``, ``embed_input_ids`` and
    ``num_image_tokens`` are :class:`~framework.multimodal.model.VisionLanguageModel`'s."""

    #: the text layers read checkpoint slices; tower and projector tensors are read whole
    reads_checkpoint_slices = True
    bidirectional_image_attention = True

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__(config, quant_config, prefix)
        self.settings = vision_settings(config, {})
        vision = config.hf_config.get("vision_config") or {}
        self.vision_tower = SiglipVisionTransformer(vision)
        self.multi_modal_projector = Gemma3Projector(
            int(vision.get("hidden_size", 768)),
            config.hidden_size,
            self.vision_tower.patches_per_side,
            int(self.settings["mm_tokens_per_image"]),
            float(vision.get("layer_norm_eps", 1e-6)),
        )
        self.image_token_id = int(self.settings["image_token_id"])
        self.span = span_ids(self.settings)

    @classmethod
    def vision_spec(cls, config: ModelConfig, preprocessor_config: dict[str, Any]) -> VisionSpec:
        settings = vision_settings(config, preprocessor_config)
        return VisionSpec(
            processor="fw_gemma.gemma3_processor:Gemma3ImageProcessor",
            processor_config=settings,
            image_token_id=settings["image_token_id"],
            layout_token_ids=[settings["boi_token_id"], settings["eoi_token_id"]],
            placeholder_token_id=settings["boi_token_id"],
            text_around_placeholder=BLANK_LINES,
        )

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, tuple | None]:
        """The tower's and projector's tensors load whole (no fused q/k/v there)."""
        return name, (() if name.startswith(("vision_tower.", "multi_modal_projector.")) else None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_parameters(self, self._renamed(weights))

    @staticmethod
    def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Both layouts onto this module's names; the pooling head is skipped unread."""
        for name, tensor in weights:
            prefix = next((p for p in VISION_PREFIXES if name.startswith(p)), None)
            if prefix is None:
                yield text_model_name(name, ()), tensor
                continue
            name = VISION_PREFIXES[prefix] + name.removeprefix(prefix)
            if not name.startswith(UNUSED_PREFIX):
                yield name, tensor

    def image_span_ids(self, grid: list[int]) -> list[int]:
        side = self.vision_tower.patches_per_side
        if list(grid) != [side, side]:
            raise ConfigError(f"a Gemma 3 image has the grid [{side}, {side}] (patches); got {grid}")
        return list(self.span)

    def embed_image(self, pixel_values: torch.Tensor, grid: list[int]) -> torch.Tensor:
        """``[mm_tokens_per_image, hidden]``: one ``[3, S, S]`` image through the tower and the projector."""
        self.image_span_ids(grid)
        return self.multi_modal_projector(self.vision_tower(pixel_values))
