"""Pixtral / Mistral 3 image preprocessing (numpy and Pillow only: it runs in the API process).

The steps of transformers' ``PixtralImageProcessorPil`` as ``PixtralProcessor`` drives it: scale
the image down (never up) so its longest side fits ``longest_edge``, round each side up to a
multiple of ``patch_size * merge_size`` (the processor's effective patch), resize (bicubic, on the
uint8 image), rescale by 1/255 and normalize. One image is one ``[3, H, W]`` array.

Its span in the prompt is one row of image tokens per ``patch_size * merge_size`` pixels of
height, each row ended by the break token, the last by the end token instead::

    H / (p * m) = 2 rows, W / (p * m) = 3 columns:
    [IMG] [IMG] [IMG] [IMG_BREAK] [IMG] [IMG] [IMG] [IMG_END]      (6 embeddings, 8 tokens)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from framework.multimodal.inputs import ProcessedImage

#: OpenAI CLIP's statistics, Pixtral's defaults; Mistral 3's tokenizer ids of the span's tokens.
DEFAULTS = {
    "longest_edge": 1540,
    "patch_size": 14,
    "merge_size": 2,
    "image_mean": (0.48145466, 0.4578275, 0.40821073),
    "image_std": (0.26862954, 0.26130258, 0.27577711),
    "rescale_factor": 1 / 255,
    "image_token_id": 10,
    "image_break_token_id": 12,
    "image_end_token_id": 13,
}


def processor_settings(preprocessor_config: dict[str, Any]) -> dict[str, Any]:
    """:data:`DEFAULTS` with a checkpoint's ``preprocessor_config.json`` over them (``size``'s
    ``longest_edge``; ``patch_size`` as an int or ``{"height", "width"}``, square only)."""
    settings = dict(DEFAULTS)
    settings.update({k: v for k, v in preprocessor_config.items() if k in DEFAULTS and v is not None})
    size = preprocessor_config.get("size") or {}
    if size.get("longest_edge"):
        settings["longest_edge"] = size["longest_edge"]
    patch = settings["patch_size"]
    if isinstance(patch, dict):
        if patch.get("height") != patch.get("width"):
            raise ValueError(f"patch_size {patch}: only square patches are supported")
        settings["patch_size"] = patch["height"]
    settings["image_mean"], settings["image_std"] = list(settings["image_mean"]), list(settings["image_std"])
    return settings


def resized_size(height: int, width: int, longest_edge: int, factor: int) -> tuple[int, int]:
    """The ``(height, width)`` the image is resized to: fitted into ``longest_edge`` (floor, as
    transformers does), then each side rounded up to a multiple of ``factor``."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = math.floor(height / ratio), math.floor(width / ratio)
    return ((height - 1) // factor + 1) * factor, ((width - 1) // factor + 1) * factor


class PixtralImageProcessor:
    """:class:`~framework.multimodal.inputs.ImageProcessor` of Pixtral and Mistral 3: ``grid`` is
    ``[H / patch_size, W / patch_size]`` (the tower's patches)."""

    def __init__(self, config: dict[str, Any]) -> None:
        settings = {**DEFAULTS, **config}
        self.patch_size, self.merge_size = int(settings["patch_size"]), int(settings["merge_size"])
        self.longest_edge = int(settings["longest_edge"])
        self.rescale_factor = float(settings["rescale_factor"])
        self.mean = np.array(settings["image_mean"], dtype=np.float32)[:, None, None]
        self.std = np.array(settings["image_std"], dtype=np.float32)[:, None, None]
        self.image_token_id = int(settings["image_token_id"])
        self.break_token_id, self.end_token_id = (
            int(settings["image_break_token_id"]),
            int(settings["image_end_token_id"]),
        )

    def _size(self, width: int, height: int) -> tuple[int, int]:
        return resized_size(height, width, self.longest_edge, self.patch_size * self.merge_size)

    def num_tokens(self, width: int, height: int) -> int:
        height, width = self._size(width, height)
        factor = self.patch_size * self.merge_size
        return height // factor * (width // factor + 1)

    def span_ids(self, rows: int, cols: int) -> list[int]:
        """The span of ``rows`` x ``cols`` merged patches (the module docstring's layout)."""
        ids = ([self.image_token_id] * cols + [self.break_token_id]) * rows
        ids[-1] = self.end_token_id
        return ids

    def preprocess(self, image: Any) -> ProcessedImage:
        from PIL import Image

        height, width = self._size(image.width, image.height)
        resized = np.asarray(image.resize((width, height), Image.Resampling.BICUBIC))  # [H, W, 3] uint8
        scaled = (resized.astype(np.float64) * self.rescale_factor).astype(np.float32).transpose(2, 0, 1)
        pixels = np.ascontiguousarray((scaled - self.mean) / self.std)
        factor = self.patch_size * self.merge_size
        span = self.span_ids(height // factor, width // factor)
        return ProcessedImage(pixels, [height // self.patch_size, width // self.patch_size], len(span), span)
