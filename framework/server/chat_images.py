"""A vision model's chat prompt: the request's ``image_url`` parts decoded, preprocessed and placed.

Every refusal is a 400 naming the content part (``messages[0].content[1]``) and happens before
anything reaches the engine: an http(s) URL or a local path the operator did not allow
(:mod:`framework.multimodal.sources`), a corrupt image or an unsupported format, more images than
the model takes. Decoding and preprocessing (Pillow and the model's
numpy image processor, :mod:`framework.multimodal`) run in a worker thread
(:func:`prepare_images_off_loop`), so a large image does not stall the event loop's other streams.
"""

from __future__ import annotations

import asyncio
from typing import Any

from framework.multimodal.images import ImageError
from framework.multimodal.inputs import ImageInput, ProcessedImage
from framework.multimodal.prompt import (
    ContentImageError,
    add_text_around_placeholders,
    expand_placeholders,
    image_parts,
    process_images,
    take_images,
    without_images,
)
from framework.server.chat_prompt import chat_prompt, template_messages
from framework.server.errors import APIError, bad_request
from framework.server.protocol import ChatCompletionRequest


def prepare_images(state: Any, messages: list[dict[str, Any]]) -> list[ProcessedImage]:
    """The messages' images decoded and preprocessed, in order (a 400 naming the part for a bad one)."""
    try:
        _, images = take_images(messages, state.vision.max_images, state.config.media_sources)
        return process_images(images, state.image_processor(), state.max_model_len)
    except ContentImageError as error:
        raise APIError(400, str(error), param=error.param, code="invalid_image") from None


async def prepare_images_off_loop(state: Any, body: ChatCompletionRequest) -> list[ProcessedImage] | None:
    """:func:`prepare_images` of a vision model's request in a worker thread; None when it has no images."""
    if state.vision is None:
        return None
    messages = template_messages(body.messages, allow_images=True)
    if not image_parts(messages):
        return None
    return await asyncio.to_thread(prepare_images, state, messages)


def chat_prompt_with_images(
    state: Any,
    body: ChatCompletionRequest,
    tools: list[dict[str, Any]] | None,
    messages: list[dict[str, Any]],
    processed: list[ProcessedImage] | None = None,
) -> tuple[str, list[int], list[ImageInput], list[ProcessedImage]]:
    """The prompt text (one placeholder per image, with the model's text around it), its ids
    (each placeholder replaced by its image's span), the images placed in them, and the
    preprocessed images (``processed``: those of :func:`prepare_images_off_loop`, else they are
    prepared here)."""
    if processed is None:
        processed = prepare_images(state, messages)
    if len(processed) != len(image_parts(messages)):
        raise bad_request("the conversation's images changed between rounds", "messages")
    vision, tokenizer = state.vision, state.client.tokenizer
    text, ids = chat_prompt(
        tokenizer,
        body,
        tools,
        without_images(messages),
        lambda rendered: add_text_around_placeholders(rendered, vision, tokenizer),
    )
    try:
        ids, inputs = expand_placeholders(
            ids, processed, vision.image_token_id, vision.layout_token_ids, vision.placeholder_token_id
        )
    except ImageError as error:
        raise bad_request(str(error), "messages") from None
    return text, ids, inputs, processed
