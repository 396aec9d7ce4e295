"""Qwen2-VL / Qwen2.5-VL image preprocessing (numpy and Pillow only: it runs in the API process).

The steps of transformers' ``Qwen2VLImageProcessorPil``: resize (bicubic, on the uint8 image) so
each side is a multiple of ``patch_size * merge_size`` and the area lies in ``[min_pixels,
max_pixels]`` keeping the aspect ratio; rescale by 1/255; normalize by the mean and std; cut into
``patch_size`` squares repeated ``temporal_patch_size`` times (a still image is one frame), in
merge-block order::

    pixel_values [grid_h * grid_w, 3 * temporal_patch_size * patch_size * patch_size]
    rows ordered (block row, block col, row in block, col in block), blocks merge_size x merge_size

The image gives ``grid_h * grid_w / merge_size**2`` embeddings (one per merged block).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from framework.multimodal.inputs import ProcessedImage

#: OpenAI CLIP's statistics, Qwen2-VL's defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULTS = {
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
    "rescale_factor": 1 / 255,
}


def processor_settings(preprocessor_config: dict[str, Any]) -> dict[str, Any]:
    """:data:`DEFAULTS` with a checkpoint's ``preprocessor_config.json`` over them (its ``size``
    ``shortest_edge`` / ``longest_edge`` are the pixel bounds, as transformers reads them)."""
    settings = dict(DEFAULTS)
    settings.update({k: v for k, v in preprocessor_config.items() if k in DEFAULTS and v is not None})
    size = preprocessor_config.get("size") or {}
    if size.get("shortest_edge"):
        settings["min_pixels"] = size["shortest_edge"]
    if size.get("longest_edge"):
        settings["max_pixels"] = size["longest_edge"]
    settings["image_mean"], settings["image_std"] = list(settings["image_mean"]), list(settings["image_std"])
    return settings


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The resized ``(height, width)``: multiples of ``factor``, area in bounds, aspect ratio kept."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the image's aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen2VLImageProcessor:
    """:class:`~framework.multimodal.inputs.ImageProcessor` of Qwen2-VL and Qwen2.5-VL."""

    def __init__(self, config: dict[str, Any]) -> None:
        settings = {**DEFAULTS, **config}
        self.patch_size = int(settings["patch_size"])
        self.temporal_patch_size = int(settings["temporal_patch_size"])
        self.merge_size = int(settings["merge_size"])
        self.min_pixels, self.max_pixels = int(settings["min_pixels"]), int(settings["max_pixels"])
        self.rescale_factor = float(settings["rescale_factor"])
        self.mean = np.array(settings["image_mean"], dtype=np.float32)[:, None, None]
        self.std = np.array(settings["image_std"], dtype=np.float32)[:, None, None]

    def num_tokens(self, width: int, height: int) -> int:
        factor = self.patch_size * self.merge_size
        resized_height, resized_width = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        return resized_height * resized_width // (factor * factor)

    def preprocess(self, image: Any) -> ProcessedImage:
        from PIL import Image

        patch, merge = self.patch_size, self.merge_size
        height, width = smart_resize(image.height, image.width, patch * merge, self.min_pixels, self.max_pixels)
        resized = np.asarray(image.resize((width, height), Image.Resampling.BICUBIC))  # [H, W, 3] uint8
        scaled = (resized.astype(np.float64) * self.rescale_factor).astype(np.float32).transpose(2, 0, 1)
        pixels = (scaled - self.mean) / self.std
        grid_h, grid_w = height // patch, width // patch
        blocks = pixels.reshape(3, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # (bh, bw, mh, mw, C, ph, pw)
        frames = np.broadcast_to(
            blocks[:, :, :, :, :, None], (*blocks.shape[:5], self.temporal_patch_size, patch, patch)
        )
        flat = np.ascontiguousarray(frames).reshape(grid_h * grid_w, -1)
        return ProcessedImage(flat, [1, grid_h, grid_w], grid_h * grid_w // (merge * merge))
