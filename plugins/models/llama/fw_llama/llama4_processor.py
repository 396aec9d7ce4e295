"""Llama 4 image preprocessing (numpy and Pillow only: it runs in the API process).

The steps of transformers' ``Llama4ImageProcessor``: pick the canvas of ``rows x cols`` tiles of
``tile_size`` pixels (``rows * cols <= max_patches``) that needs the least scaling (the smallest
upscale, else the least downscale; the smallest area among equals), resize the image into it
without distortion (bilinear, never upscaled past one tile side unless ``resize_to_max_canvas``),
pad it bottom-right with black, rescale and normalize in bfloat16 (as Meta's reference does), and
cut it into tiles row-major; a canvas of more than one tile adds a global thumbnail, the whole
image resized to one tile. One image is ``[tiles (+ 1), 3, tile_size, tile_size]``.

Each tile takes ``(tile_size / patch_size)**2 * pixel_shuffle_ratio**2`` embeddings (``n``). The
span, for a canvas of 2 x 2 tiles (``P`` = ``<|patch|>``, the image token the embeddings fill)::

    <|image_start|> P*n <|tile_x_separator|> P*n <|tile_y_separator|>
                    P*n <|tile_x_separator|> P*n <|tile_y_separator|>
                    <|image|> P*n <|image_end|>                       (global thumbnail last)

and for one tile ``<|image_start|> <|image|> P*n <|image_end|>``. The chat template writes
``<|image|>`` once per image; the span replaces it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from framework.multimodal.inputs import ProcessedImage

#: Llama 4's settings and its tokenizer's ids of the span's tokens (Scout / Maverick).
DEFAULTS = {
    "tile_size": 336,
    "max_patches": 16,
    "resize_to_max_canvas": False,
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
    "rescale_factor": 1 / 255,
    "patch_size": 14,
    "pixel_shuffle_ratio": 0.5,
    "image_start_token_id": 200080,
    "image_end_token_id": 200081,
    "tile_x_separator_token_id": 200084,
    "tile_y_separator_token_id": 200085,
    "image_placeholder_token_id": 200090,
    "patch_token_id": 200092,
}
#: PIL's number for bilinear resampling, the only one Llama 4's processor is used with
BILINEAR = 2


def processor_settings(preprocessor_config: dict[str, Any]) -> dict[str, Any]:
    """:data:`DEFAULTS` with a checkpoint's ``preprocessor_config.json`` over them (``size``: a
    square ``{"height", "width"}``; ``max_patches``, ``resize_to_max_canvas``, statistics)."""
    settings = dict(DEFAULTS)
    for key in ("max_patches", "resize_to_max_canvas", "image_mean", "image_std", "rescale_factor"):
        if preprocessor_config.get(key) is not None:
            settings[key] = preprocessor_config[key]
    size = preprocessor_config.get("size") or {}
    if size:
        if size.get("height") != size.get("width"):
            raise ValueError(f"size {size}: Llama 4 takes square tiles only ({{'height': n, 'width': n}})")
        settings["tile_size"] = int(size["height"])
    resample = preprocessor_config.get("resample", BILINEAR)
    if resample != BILINEAR:
        raise ValueError(f"resample {resample!r}: Llama 4's processor resizes bilinearly ({BILINEAR}) only")
    settings["image_mean"], settings["image_std"] = list(settings["image_mean"]), list(settings["image_std"])
    return settings


def canvases(max_tiles: int) -> list[tuple[int, int]]:
    """Every ``(rows, cols)`` of at most ``max_tiles`` tiles, grouped by aspect ratio in the order
    transformers lists them (its tie-break among canvases of equal area keeps the first)."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_tiles, 0, -1):
        for rows in sorted({d for d in range(1, count + 1) if count % d == 0}):
            by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return [canvas for group in by_ratio.values() for canvas in group]


def best_canvas(height: int, width: int, tile: int, max_tiles: int, to_max: bool) -> tuple[int, int]:
    """The ``(rows, cols)`` the image is laid on (module docstring)."""
    options = canvases(max_tiles)
    scales = [min(rows * tile / height, cols * tile / width) for rows, cols in options]
    upscales = [s for s in scales if s >= 1]
    chosen = (max(upscales) if to_max else min(upscales)) if upscales else max(scales)
    fits = [canvas for canvas, scale in zip(options, scales) if scale == chosen]
    return min(fits, key=lambda canvas: canvas[0] * canvas[1])  # min keeps the first of equal areas


def fitted_size(height: int, width: int, target_height: int, target_width: int) -> tuple[int, int]:
    """The largest ``(height, width)`` of the image's aspect inside the target (floored)."""
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return max(min(math.floor(height * scale_w), target_height), 1), max(target_width, 1)
    return max(target_height, 1), max(min(math.floor(width * scale_h), target_width), 1)


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), kept as float32."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


class Llama4ImageProcessor:
    """:class:`~framework.multimodal.inputs.ImageProcessor` of Llama 4: ``grid`` is ``[rows, cols]``
    of the canvas, in tiles."""

    def __init__(self, config: dict[str, Any]) -> None:
        settings = {**DEFAULTS, **config}
        self.tile = int(settings["tile_size"])
        self.max_tiles, self.to_max = int(settings["max_patches"]), bool(settings["resize_to_max_canvas"])
        self.rescale_factor = float(settings["rescale_factor"])
        self.mean = to_bfloat16(np.array(settings["image_mean"], dtype=np.float32))[:, None, None]
        self.std = to_bfloat16(np.array(settings["image_std"], dtype=np.float32))[:, None, None]
        patches = (self.tile // int(settings["patch_size"])) ** 2
        self.tokens_per_tile = int(round(patches * float(settings["pixel_shuffle_ratio"]) ** 2))
        self.ids = {key: int(settings[key]) for key in DEFAULTS if key.endswith("_token_id")}

    def canvas(self, width: int, height: int) -> tuple[int, int]:
        return best_canvas(height, width, self.tile, self.max_tiles, self.to_max)

    def num_tokens(self, width: int, height: int) -> int:
        return len(self.span_ids(*self.canvas(width, height)))

    def span_ids(self, rows: int, cols: int) -> list[int]:
        """The span of a canvas of ``rows x cols`` tiles (the module docstring's layout)."""
        ids, patches = self.ids, [self.ids["patch_token_id"]] * self.tokens_per_tile
        span = [ids["image_start_token_id"]]
        if rows * cols > 1:
            row = (patches + [ids["tile_x_separator_token_id"]]) * cols
            span += (row[:-1] + [ids["tile_y_separator_token_id"]]) * rows
        return span + [ids["image_placeholder_token_id"], *patches, ids["image_end_token_id"]]

    def _normalized(self, image: np.ndarray) -> np.ndarray:
        """``[H, W, 3]`` uint8 -> ``[3, H, W]`` float32 holding bfloat16 values: each step rounded
        to bfloat16, as transformers computes it in that dtype."""
        scaled = to_bfloat16(image.astype(np.float32).transpose(2, 0, 1) * np.float32(self.rescale_factor))
        return to_bfloat16(to_bfloat16(scaled - self.mean) / self.std)

    def preprocess(self, image: Any) -> ProcessedImage:
        from PIL import Image

        rows, cols = self.canvas(image.width, image.height)
        target_height, target_width = rows * self.tile, cols * self.tile
        if not self.to_max:  # never upscale past one tile side
            target_height = min(max(image.height, self.tile), target_height)
            target_width = min(max(image.width, self.tile), target_width)
        height, width = fitted_size(image.height, image.width, target_height, target_width)
        resized = np.asarray(image.resize((width, height), Image.Resampling.BILINEAR))
        canvas = np.zeros((rows * self.tile, cols * self.tile, 3), dtype=np.uint8)
        canvas[:height, :width] = resized
        pixels = self._normalized(canvas)  # [3, rows * tile, cols * tile] -> tiles row-major
        tiles = pixels.reshape(3, rows, self.tile, cols, self.tile).transpose(1, 3, 0, 2, 4)
        tiles = tiles.reshape(rows * cols, 3, self.tile, self.tile)
        if rows * cols > 1:
            thumbnail = np.asarray(image.resize((self.tile, self.tile), Image.Resampling.BILINEAR))
            tiles = np.concatenate([tiles, self._normalized(thumbnail)[None]])
        span = self.span_ids(rows, cols)
        return ProcessedImage(np.ascontiguousarray(tiles), [rows, cols], len(span), span)
