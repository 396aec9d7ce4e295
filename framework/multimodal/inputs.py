"""What crosses the process boundary for images: the model's :class:`VisionSpec` and each
prompt's :class:`ImageInput` (msgspec structs, so they travel in ``Ready`` and ``AddRequest``)."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import msgspec
import numpy as np

from framework.specs import Spec

#: The most images one prompt may hold unless the model's spec says otherwise.
DEFAULT_MAX_IMAGES = 8


class VisionSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How a model takes images (declared by the model class, sent to the API process in ``Ready``).

    ``processor``: a ``"module:Class"`` :class:`ImageProcessor` importable without torch;
    ``processor_config``: its settings (the checkpoint's ``preprocessor_config.json`` merged over
    the model's defaults); ``image_token_id``: the token the chat template writes once per image,
    which the prompt repeats once per image embedding; ``layout_token_ids``: the other tokens an
    image's span may hold (Pixtral's row break and image end), which keep their token embeddings;
    ``placeholder_token_id``: for a model whose template writes another token than its image
    token (Llama 4: ``<|image|>``, its embeddings going to ``<|patch|>`` tokens), that token, which
    the span replaces (and may hold again as a layout token); ``text_around_placeholder``: the
    text put before and after each placeholder the template writes, in the prompt text, before it
    is tokenized (Gemma 3: a blank line each side, as its processor writes them; they merge with
    neighbouring newlines into one token, so they cannot be added as ids afterwards);
    ``max_images``: per prompt.
    """

    processor: str
    processor_config: dict[str, Any] = {}
    image_token_id: int
    layout_token_ids: list[int] = []
    placeholder_token_id: int | None = None
    text_around_placeholder: tuple[str, str] = ("", "")
    max_images: int = DEFAULT_MAX_IMAGES


class ImageInput(msgspec.Struct, kw_only=True):
    """One preprocessed image of a prompt: ``pixel_values`` float32 bytes of ``shape``, the
    model's ``grid`` for it (Qwen2-VL: ``[t, h, w]`` in patches) and the prompt span of its
    tokens, ``offset`` .. ``offset + length`` (image tokens, and any layout tokens of the model)."""

    pixel_values: bytes
    shape: list[int]
    grid: list[int]
    offset: int
    length: int

    def array(self) -> np.ndarray:
        return np.frombuffer(self.pixel_values, dtype=np.float32).reshape(self.shape)


class ProcessedImage(NamedTuple):
    """An image processor's output: the model's pixel array, its grid, the number of prompt tokens
    its span takes and, for a model whose span holds layout tokens, the span's ids in order (None:
    ``num_tokens`` image tokens, one per embedding)::

        Qwen2-VL   span_ids None:  <image> x num_tokens
        Pixtral    span_ids:       <img> <img> <break> <img> <img> <break> <img> <img> <end>
    """

    pixel_values: np.ndarray
    grid: list[int]
    num_tokens: int
    span_ids: list[int] | None = None


class ImageProcessor(Protocol):
    """Turns a decoded RGB image into the model's pixels (numpy and Pillow only: it runs in the API process)."""

    def __init__(self, config: dict[str, Any]) -> None: ...

    def num_tokens(self, width: int, height: int) -> int:
        """How many prompt tokens an image of this size takes (cheap: checked before :meth:`preprocess`)."""
        ...

    def preprocess(self, image: Any) -> ProcessedImage:
        """``image`` is an RGB ``PIL.Image.Image``; raises ValueError for one the model cannot take."""
        ...


def load_processor(spec: VisionSpec) -> ImageProcessor:
    """The spec's image processor, built from its settings."""
    return Spec(name="image processor", impl=spec.processor).load()(dict(spec.processor_config))
