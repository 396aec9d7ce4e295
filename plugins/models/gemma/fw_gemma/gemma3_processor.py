"""Gemma 3 image preprocessing (numpy and Pillow only: it runs in the API process).

The steps of transformers' ``Gemma3ImageProcessorPil`` with pan-and-scan off (its default): resize
the RGB image to the tower's ``size`` (square, ``image_size``; Pillow's ``resample``, bilinear by
default, on the uint8 image), rescale by 1/255 and normalize. One image is one ``[3, S, S]`` array
whatever its size; every image becomes ``mm_tokens_per_image`` embeddings.

Its span in the prompt replaces the ``<start_of_image>`` the chat template writes, as
``Gemma3Processor`` lays it out, blank lines (:data:`BLANK_LINES`) around it in the text before
tokenizing, where they merge with the newlines beside them (``"\n" + "\n\n"`` is one token)::

    template text:  ...user\n<start_of_image>Describe...
    prompt text:    ...user\n\n\n<start_of_image>\n\nDescribe...
    prompt ids:     ... "\n\n\n" <start_of_image> <image_soft_token> x mm_tokens_per_image <end_of_image> "\n\n" ...
"""

from __future__ import annotations

from typing import Any

import numpy as np

from framework.multimodal.inputs import ProcessedImage

#: gemma-3-4b-it's settings and token ids (``preprocessor_config.json`` and the model config override them)
DEFAULTS = {
    "image_size": 896,
    "patch_size": 14,
    "mm_tokens_per_image": 256,
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
    "rescale_factor": 1 / 255,
    "resample": 2,  # PIL.Image.Resampling.BILINEAR
    "image_token_id": 262_144,
    "boi_token_id": 255_999,
    "eoi_token_id": 256_000,
}

#: the text ``Gemma3Processor`` writes before and after each image's tokens
BLANK_LINES = ("\n\n", "\n\n")


def processor_settings(preprocessor_config: dict[str, Any]) -> dict[str, Any]:
    """:data:`DEFAULTS` with a checkpoint's ``preprocessor_config.json`` over them (``size`` as
    ``{"height", "width"}``, square only). Raises ValueError for pan-and-scan, which is not built."""
    settings = dict(DEFAULTS)
    settings.update({k: v for k, v in preprocessor_config.items() if k in DEFAULTS and v is not None})
    size = preprocessor_config.get("size") or {}
    if size:
        if size.get("height") != size.get("width"):
            raise ValueError(f"Gemma 3 image size {size}: only square images are supported")
        settings["image_size"] = int(size["height"])
    if preprocessor_config.get("do_pan_and_scan"):
        raise ValueError("Gemma 3's pan-and-scan crops are not supported; set do_pan_and_scan to false")
    settings["image_mean"], settings["image_std"] = list(settings["image_mean"]), list(settings["image_std"])
    return settings


def span_ids(settings: dict[str, Any]) -> list[int]:
    """The prompt ids of one image's span (the module docstring's layout)."""
    tokens = int(settings["mm_tokens_per_image"])
    return [int(settings["boi_token_id"]), *[int(settings["image_token_id"])] * tokens, int(settings["eoi_token_id"])]


class Gemma3ImageProcessor:
    """:class:`~framework.multimodal.inputs.ImageProcessor` of Gemma 3: ``grid`` is the tower's
    ``[S / patch_size, S / patch_size]`` patches."""

    def __init__(self, config: dict[str, Any]) -> None:
        settings = {**DEFAULTS, **config}
        self.image_size, self.patch_size = int(settings["image_size"]), int(settings["patch_size"])
        self.resample = int(settings["resample"])
        self.rescale_factor = float(settings["rescale_factor"])
        self.mean = np.array(settings["image_mean"], dtype=np.float32)[:, None, None]
        self.std = np.array(settings["image_std"], dtype=np.float32)[:, None, None]
        self.span = span_ids(settings)

    def num_tokens(self, width: int, height: int) -> int:
        return len(self.span)

    def preprocess(self, image: Any) -> ProcessedImage:
        size = self.image_size
        resized = np.asarray(image.resize((size, size), self.resample))  # [S, S, 3] uint8
        scaled = (resized.astype(np.float64) * self.rescale_factor).astype(np.float32).transpose(2, 0, 1)
        pixels = np.ascontiguousarray((scaled - self.mean) / self.std)
        patches = size // self.patch_size
        return ProcessedImage(pixels, [patches, patches], len(self.span), list(self.span))
