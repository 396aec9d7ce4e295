"""Images in chat messages: take them out of the content parts, preprocess them, and expand
each image's placeholder token in the prompt ids (shared by the API process and :class:`framework.LLM`).

A message's content parts ``{"type": "image_url", "image_url": {"url": "data:..."}}`` (or, in
process, ``{"type": "image", "image": <PIL.Image>}``) become ``{"type": "image"}`` for the chat
template, which writes the model's image token once per image. After tokenizing, the i-th image
token becomes that image's span: the image token repeated ``num_tokens`` times (its embeddings'
count), or the processor's ``span_ids`` where the model lays its image tokens out with others
(Pixtral's row breaks and image end)::

    template ids:  ... <vision_start> <image_pad> <vision_end> ...
    prompt ids:    ... <vision_start> <image_pad> x num_tokens <vision_end> ...
                                      ^ offset of ImageInput i, length num_tokens

    template ids:  ... [IMG] ...
    prompt ids:    ... [IMG] [IMG] [IMG_BREAK] [IMG] [IMG] [IMG_END] ...   (span_ids, 2 x 2 embeddings)

A model may name a placeholder other than its image token (``VisionSpec.placeholder_token_id``)::

    template ids:  ... <|image|> ...
    prompt ids:    ... <|image_start|> <|image|> <|patch|> x num_embeddings <|image_end|> ...   (Llama 4)

A model whose processor also writes text around each image (``VisionSpec.text_around_placeholder``)
gets it in the template's text before tokenizing, where it merges with the text beside it as the
processor's does (:func:`add_text_around_placeholders`); the span itself is still placed by id::

    template text: ...user\n<start_of_image>look<end_of_turn>...
    prompt text:   ...user\n\n\n<start_of_image>\n\nlook<end_of_turn>...             (Gemma 3)
    prompt ids:    ... "user" "\n\n\n" <start_of_image> <image_soft_token> x 256 <end_of_image> "\n\n" "look" ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from framework.errors import ConfigError
from framework.multimodal.images import ImageError, decode_image_url, image_url_of, to_rgb
from framework.multimodal.inputs import ImageInput, ImageProcessor, ProcessedImage, VisionSpec

if TYPE_CHECKING:
    from framework.tokenizer import Tokenizer

IMAGE_PART_TYPES = ("image_url", "image")


class ContentImageError(ImageError):
    """An :class:`ImageError` of one content part, ``param`` naming it (``messages[0].content[1]``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class PromptImage(NamedTuple):
    param: str  # the content part it came from, for errors
    image: Any  # an RGB PIL.Image.Image


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def first_image_part(messages: list[dict[str, Any]]) -> str | None:
    """The name of the first image content part in ``messages`` (``messages[i].content[j]``), or None."""
    found = image_parts(messages)
    return found[0][0] if found else None


def image_parts(messages: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Every image content part of ``messages`` in order, with its name (``messages[i].content[j]``)."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            found += [(f"messages[{i}].content[{j}]", part) for j, part in enumerate(content) if is_image_part(part)]
    return found


def without_images(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each image part replaced by ``{"type": "image"}`` (what the template sees)."""
    return [
        {**message, "content": [{"type": "image"} if is_image_part(part) else part for part in message["content"]]}
        if isinstance(message.get("content"), list)
        else message
        for message in messages
    ]


def take_images(
    messages: list[dict[str, Any]], max_images: int, sources: Any = None
) -> tuple[list[dict[str, Any]], list[PromptImage]]:
    """:func:`without_images` of the messages, and the decoded images in order (``sources``: the
    :class:`~framework.multimodal.sources.MediaSources` beyond data URLs). Raises
    :class:`ContentImageError` for an image that cannot be decoded or one past ``max_images``."""
    from PIL import Image

    images = []
    for param, part in image_parts(messages):
        if len(images) == max_images:
            raise ContentImageError(param, f"too many images: this model takes at most {max_images} per prompt")
        try:
            value = part.get("image")
            if isinstance(value, Image.Image):
                image = to_rgb(value)
            elif part["type"] == "image":
                raise ImageError("an image part holds a PIL image under 'image'; send image_url parts over HTTP")
            else:
                image = decode_image_url(image_url_of(part), sources)
        except ImageError as error:
            raise ContentImageError(param, str(error)) from None
        images.append(PromptImage(param, image))
    return without_images(messages), images


def process_images(
    images: list[PromptImage], processor: ImageProcessor, max_tokens: int | None = None
) -> list[ProcessedImage]:
    """Each image through the model's processor (:class:`ContentImageError` for one it refuses, or
    for the first image that takes the images' embeddings past ``max_tokens``, the context length:
    counted from the sizes, before any pixel array is built)."""
    processed, total = [], 0
    for item in images:
        try:
            total += processor.num_tokens(item.image.width, item.image.height)
            if max_tokens is not None and total > max_tokens:
                raise ValueError(
                    f"the images up to this one take {total} tokens; the model's context is {max_tokens} tokens"
                )
            processed.append(processor.preprocess(item.image))
        except ValueError as error:
            raise ContentImageError(item.param, str(error)) from None
    return processed


def image_span(image: ProcessedImage, image_token_id: int, layout_token_ids: tuple[int, ...] = ()) -> list[int]:
    """The prompt ids of ``image``'s span: its ``span_ids``, else ``num_tokens`` image tokens.
    Raises ImageError for a span of the wrong length or holding ids other than the image token
    and ``layout_token_ids`` (a processor that disagrees with its model's spec)."""
    if image.span_ids is None:
        return [image_token_id] * image.num_tokens
    allowed = {image_token_id, *layout_token_ids}
    if len(image.span_ids) != image.num_tokens:
        raise ImageError(f"the image processor gave a span of {len(image.span_ids)} ids for {image.num_tokens} tokens")
    if not allowed.issuperset(image.span_ids):
        raise ImageError(
            f"the image processor's span holds ids {sorted(set(image.span_ids) - allowed)} outside the model's "
            f"image and layout tokens {sorted(allowed)}"
        )
    return list(image.span_ids)


def expand_placeholders(
    prompt_ids: list[int],
    processed: list[ProcessedImage],
    image_token_id: int,
    layout_token_ids: tuple[int, ...] | list[int] = (),
    placeholder_token_id: int | None = None,
) -> tuple[list[int], list[ImageInput]]:
    """``prompt_ids`` with the i-th placeholder (``placeholder_token_id``, else ``image_token_id``)
    replaced by image i's span (:func:`image_span`), and the images' :class:`ImageInput` (their
    spans in the new ids). Raises ImageError when the template wrote a different number of
    placeholders than there are images."""
    placeholder = image_token_id if placeholder_token_id is None else placeholder_token_id
    where = [index for index, token in enumerate(prompt_ids) if token == placeholder]
    if len(where) != len(processed):
        raise ImageError(
            f"the chat template wrote {len(where)} image tokens for {len(processed)} images; "
            "this model's template must place each image part"
        )
    ids: list[int] = []
    inputs = []
    previous = 0
    for index, image in zip(where, processed):
        ids.extend(prompt_ids[previous:index])
        pixels = image.pixel_values
        inputs.append(
            ImageInput(
                pixel_values=pixels.astype("float32", copy=False).tobytes(),
                shape=list(pixels.shape),
                grid=list(image.grid),
                offset=len(ids),
                length=image.num_tokens,
            )
        )
        ids.extend(image_span(image, image_token_id, tuple(layout_token_ids)))
        previous = index + 1
    ids.extend(prompt_ids[previous:])
    return ids, inputs


def add_text_around_placeholders(text: str, spec: VisionSpec, tokenizer: Tokenizer) -> str:
    """``text`` with ``spec.text_around_placeholder`` around each placeholder token's text in it.

    For the template's own text only (a client's text that spells the placeholder is not an image:
    :func:`framework.server.chat_tokens.encode_chat` keeps it out). Raises ConfigError where the
    tokenizer has no text for the placeholder token (a spec that does not fit its tokenizer)."""
    before, after = spec.text_around_placeholder
    if not (before or after):
        return text
    placeholder = spec.image_token_id if spec.placeholder_token_id is None else spec.placeholder_token_id
    marker = tokenizer.id_to_token(placeholder)
    if not marker:
        raise ConfigError(f"the tokenizer has no token {placeholder}, which the model names as its image placeholder")
    return text.replace(marker, before + marker + after)


def vision_prompt(
    messages: list[dict[str, Any]],
    spec: VisionSpec,
    processor: ImageProcessor,
    tokenizer: Tokenizer,
    render: Callable[[list[dict[str, Any]]], str],
    max_tokens: int | None = None,
) -> tuple[list[int], list[ImageInput]]:
    """The prompt ids of ``messages`` with their images preprocessed and placed; raises
    :class:`ContentImageError` / ImageError for bad images. ``render`` renders messages with the
    chat template; the text, with the model's text around its placeholders, is tokenized with
    special-token text as control tokens (an in-process caller's text is its own; the API process
    keeps a client's text out of them: :mod:`framework.server.chat_images`)."""
    shaped, images = take_images(messages, spec.max_images)
    processed = process_images(images, processor, max_tokens)
    text = add_text_around_placeholders(render(shaped), spec, tokenizer)
    return expand_placeholders(
        tokenizer.encode(text, add_special_tokens=False),
        processed,
        spec.image_token_id,
        spec.layout_token_ids,
        spec.placeholder_token_id,
    )
