"""Images inside the engine: checked at ``add_request``, encoded inside the prefill step that
first reaches their tokens, and kept on the request (the encoder cache) until it finishes.

A vision model class provides, besides ``forward(input_ids, positions, inputs_embeds=None)``:

- ``vision_spec(config, preprocessor_config) -> VisionSpec`` (classmethod; for the API process);
- ``image_token_id``, ``num_image_tokens(grid)`` (the prompt tokens of an image's span) and
  ``embed_image(pixel_values, grid) -> [num_embeddings, width]``, one row per image token of the
  span; ``embed_input_ids(input_ids) -> [T, width]``, ``width`` being ``hidden`` or, for a model
  that sends more per image token (Qwen3-VL's DeepStack features), wider: the step's
  ``inputs_embeds`` are then as wide;
- optionally ``image_span_ids(grid) -> list[int]``, for a model whose span holds layout tokens
  besides image tokens (Pixtral's row breaks and image end); without it the span is
  ``num_image_tokens(grid)`` image tokens. A layout token keeps its token embedding;
- optionally ``rope_positions(num_tokens, spans) -> ([3, num_tokens], delta)`` (M-RoPE): the
  prompt's positions, ``spans`` being each image's ``(offset, length, grid)``; a token past the
  prompt at index ``i`` has position ``i + delta`` in every section.

:class:`framework.multimodal.model.VisionLanguageModel` gives ``forward``, ``embed_input_ids`` and
``num_image_tokens`` over the class's text decoder.

A step whose tokens cover part of an image takes those rows of its embeddings::

    request tokens   [ text | image 0 (offset, length) | text ... ]
    this step        [start ........ end)
    rows copied      image 0 embeddings [max(start, offset) - offset : min(end, offset + length) - offset]

With layout tokens in the span, embedding ``k`` belongs to the span's ``k``-th image token
(``RequestImage.embed_positions``); the step copies the rows of the image tokens it covers::

    span             [img img brk img img end]      embed_positions [0 1 3 4]
    this step              [.......)                 covers span 2..4: embedding 2 at span position 3

An image is encoded once per request (``Request.image_embeds``): a chunked prefill that splits
its tokens, a prefix-cache hit that covers part of them, or a preemption reuse the same output.

A model with ``bidirectional_image_attention = True`` (Gemma 3) lets the image tokens of one image
(its first to its last, ``RequestImage.bidirectional``) attend to each other. Such a span is never
split across steps (:func:`whole_span_tokens`: a chunk ends before the span, or runs to its end),
so the step that computes any of its tokens holds all the later ones, and the step's
``AttentionMetadata.span_ends`` (:meth:`MultiModalStep.span_ends`) widens their keys to the span's end::

    positions        0 1 2     3 4 5 6 7     8         bidirectional span 3..6 (first, end 7)
    request tokens   t t <boi> i i i i <eoi> t
    chunks of 5      [t t <boi>) [i i i i <eoi>) [t ...     not [t t <boi> i i) [i i ...
    span_ends        1 2 3       7 7 7 7 8       9
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash
from torch import nn

from framework.engine.transfer import to_device
from framework.errors import ConfigError
from framework.multimodal.inputs import ImageInput

if TYPE_CHECKING:
    from framework.engine.request import Request
    from framework.engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class RequestImage:
    """An image of a request: its pixels (host), grid, prompt span and content hash;
    ``embed_positions``: the span positions of its image tokens, in order (None: the whole span)."""

    pixel_values: torch.Tensor
    grid: list[int]
    offset: int
    length: int
    image_hash: int
    embed_positions: np.ndarray | None = None
    #: request positions ``(first, end)`` of the image tokens that attend to each other, or None (causal)
    bidirectional: tuple[int, int] | None = None

    def covered(self, start: int, end: int) -> tuple[np.ndarray, slice] | None:
        """The request rows ``start:end`` that hold this image's embeddings (request positions),
        and the slice of its embeddings they take; None when the range covers none."""
        first, last = max(start, self.offset) - self.offset, min(end, self.offset + self.length) - self.offset
        if first >= last:
            return None
        if self.embed_positions is None:
            return np.arange(first, last) + self.offset, slice(first, last)
        low, high = np.searchsorted(self.embed_positions, (first, last))
        if low == high:
            return None
        return self.embed_positions[low:high] + self.offset, slice(int(low), int(high))


def expected_span(model: nn.Module, grid: list[int]) -> list[int]:
    """The prompt ids of an image's span for ``model``: its ``image_span_ids(grid)``, else its image
    token ``num_image_tokens(grid)`` times."""
    if hasattr(model, "image_span_ids"):
        return list(model.image_span_ids(grid))
    return [model.image_token_id] * model.num_image_tokens(grid)


def is_vision_model(model: nn.Module) -> bool:
    return hasattr(model, "embed_image")


def request_images(model: nn.Module, prompt_token_ids: list[int], inputs: list[ImageInput]) -> list[RequestImage]:
    """The images of a new request, checked against the model and the prompt (ConfigError otherwise)."""
    if not is_vision_model(model):
        raise ConfigError(f"this model ({type(model).__name__}) does not take images; send text only")
    images, previous_end = [], 0
    for index, item in enumerate(inputs):
        span = expected_span(model, item.grid)
        end = item.offset + item.length
        if item.length != len(span) or item.offset < previous_end or end > len(prompt_token_ids):
            raise ConfigError(
                f"image {index}: its {item.length} placeholder tokens at {item.offset} do not fit the prompt "
                f"({len(prompt_token_ids)} tokens, images in order) or its grid {item.grid} ({len(span)} tokens)"
            )
        if prompt_token_ids[item.offset : end] != span:
            layout = sorted(set(span) - {model.image_token_id})
            raise ConfigError(
                f"image {index}: its span is not the image token {model.image_token_id}"
                + (f" laid out with the model's layout tokens {layout}" if layout else "")
                + f" as its grid {item.grid} places them"
            )
        expected_bytes = int(np.prod(item.shape)) * 4
        if len(item.pixel_values) != expected_bytes:
            raise ConfigError(f"image {index}: {len(item.pixel_values)} pixel bytes for shape {item.shape}")
        hasher = xxhash.xxh64(item.pixel_values)
        hasher.update(repr(item.grid).encode())
        pixels = torch.from_numpy(item.array().copy())
        is_image = np.asarray(span) == model.image_token_id
        positions = None if is_image.all() else np.flatnonzero(is_image)
        bidirectional = None
        if getattr(model, "bidirectional_image_attention", False):
            first, last = (0, item.length - 1) if positions is None else (int(positions[0]), int(positions[-1]))
            bidirectional = (item.offset + first, item.offset + last + 1)
        images.append(
            RequestImage(
                pixels, list(item.grid), item.offset, item.length, hasher.intdigest(), positions, bidirectional
            )
        )
        previous_end = end
    return images


def attach_images(model: nn.Module, request: Request, images: list[RequestImage]) -> None:
    """Give ``request`` its images and, for an M-RoPE model, its prompt positions."""
    request.images = images
    if hasattr(model, "rope_positions"):
        spans = [(image.offset, image.length, image.grid) for image in images]
        request.rope_positions, request.rope_delta = model.rope_positions(request.num_prompt_tokens, spans)


def longest_bidirectional_span(images: list[RequestImage]) -> int:
    """The most tokens of one bidirectional span among ``images`` (0: none); a step must hold it whole."""
    return max((image.bidirectional[1] - image.bidirectional[0] for image in images if image.bidirectional), default=0)


def whole_span_tokens(request: Request, num_new: int, budget: int) -> int:
    """``num_new`` tokens from ``request.num_computed_tokens`` adjusted so the step splits no
    bidirectional span: cut back to a span's start, or, for a step that starts at or inside one,
    run to its end (past the prefill chunk size, within ``budget``; 0 when the budget is short)."""
    start = request.num_computed_tokens
    end = start + num_new
    for image in request.images:
        if image.bidirectional is None:
            continue
        first, last = image.bidirectional
        if first < end < last:
            if first > start:
                return first - start
            return last - start if last - start <= budget else 0
    return num_new


def image_keys(request: Request, start: int, end: int) -> tuple[int, ...]:
    """The hashes of the request's images with tokens in ``start:end`` (a block's extra prefix-cache keys)."""
    return tuple(
        image.image_hash for image in request.images if image.offset < end and image.offset + image.length > start
    )


class MultiModalStep:
    """The image embeddings and M-RoPE positions of one step, for a vision model's runner."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.uses_mrope = hasattr(model, "rope_positions")
        self.num_encoder_runs = 0  # images encoded so far (each once per request)

    def applies(self, batch: ScheduledBatch) -> bool:
        return any(request.images or request.rope_delta for request in batch.requests)

    def span_ends(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """The step's ``AttentionMetadata.span_ends`` (``[T]`` int32 on the device), or None when it
        computes no token of a bidirectional span (every decode step: no array is built then)."""
        touched, row = [], 0  # (row of the span's first computed token, its first and end positions)
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            for image in request.images:
                if image.bidirectional is not None and image.bidirectional[0] < end and image.bidirectional[1] > start:
                    first, last = image.bidirectional
                    assert last <= end, "a bidirectional span was split across steps"
                    touched.append((row + max(first, start) - start, max(first, start), last))
            row += num_new
        if not touched:
            return None
        starts = np.repeat([r.num_computed_tokens for r in batch.requests], batch.num_new_tokens)
        offsets = np.arange(row) - np.repeat(np.cumsum([0, *batch.num_new_tokens[:-1]]), batch.num_new_tokens)
        ends = (starts + offsets + 1).astype(np.int32)  # causal: own position + 1
        for at, first, last in touched:
            ends[at : at + last - first] = last
        return to_device(torch.from_numpy(ends), self.device)

    def prepare(
        self, batch: ScheduledBatch, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's positions (``[3, T]`` when it covers M-RoPE prompt tokens) and its input
        embeddings with image rows (None when no image token is computed)."""
        rows: list[int] = []
        pieces: list[torch.Tensor] = []
        row = 0
        for request, num_new in zip(batch.requests, batch.num_new_tokens):
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            for index, image in enumerate(request.images):
                covered = image.covered(start, end)
                if covered is not None:
                    at, embeddings = covered
                    rows.extend((at + row - start).tolist())
                    pieces.append(self._encoded(request, index)[embeddings])
            row += num_new
        if self.uses_mrope:
            positions = self._positions(batch, positions)
        if not pieces:
            return positions, None
        embeds = self.model.embed_input_ids(input_ids)
        index = to_device(torch.tensor(rows, dtype=torch.int64), self.device)
        return positions, embeds.index_copy(0, index, torch.cat(pieces).to(embeds.dtype))

    def _encoded(self, request: Request, index: int) -> torch.Tensor:
        embeds = request.image_embeds.get(index)
        if embeds is None:
            image = request.images[index]
            embeds = self.model.embed_image(to_device(image.pixel_values, self.device), image.grid)
            request.image_embeds[index] = embeds
            self.num_encoder_runs += 1
        return embeds

    def _positions(self, batch: ScheduledBatch, positions: torch.Tensor) -> torch.Tensor:
        """Every token's M-RoPE position: ``[3, T]`` when some token lies in a prompt with images,
        else ``[T]``: ``positions`` (the token indices, on the device) plus each request's delta."""
        spans = [
            (r, r.num_computed_tokens, r.num_computed_tokens + n) for r, n in zip(batch.requests, batch.num_new_tokens)
        ]
        if not any(r.rope_positions is not None and start < r.num_prompt_tokens for r, start, _ in spans):
            deltas = np.repeat([r.rope_delta for r in batch.requests], batch.num_new_tokens)  # decode: one add
            return positions + to_device(torch.from_numpy(deltas), self.device)
        parts = []
        for request, start, end in spans:
            table = request.rope_positions
            if table is not None and start < request.num_prompt_tokens:
                split = min(end, request.num_prompt_tokens)
                tail = torch.arange(split, end).expand(3, -1) + request.rope_delta
                parts.append(torch.cat((table[:, start:split], tail), dim=1))
            else:
                parts.append((torch.arange(start, end) + request.rope_delta).expand(3, -1))
        return to_device(torch.cat(parts, dim=-1).contiguous(), self.device)
