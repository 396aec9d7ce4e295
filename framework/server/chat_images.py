"""A vision model's chat prompt: the request's ``image_url`` parts decoded, preprocessed and placed.

Every refusal is a 400 naming the content part (``messages[0].content[1]``) and happens before
anything reaches the engine: an http(s) URL or a local path, a corrupt image or an unsupported
format, more images than the model takes. Decoding runs in the API process (Pillow and the
model's numpy image processor, :mod:`framework.multimodal`).
"""

from __future__ import annotations

from typing import Any

from framework.multimodal.images import ImageError
from framework.multimodal.inputs import ImageInput
from framework.multimodal.prompt import ContentImageError, expand_placeholders, take_images
from framework.server.chat_prompt import chat_prompt
from framework.server.errors import APIError, bad_request
from framework.server.protocol import ChatCompletionRequest


def chat_prompt_with_images(
    state: Any, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]]
) -> tuple[str, list[int], list[ImageInput]]:
    """The prompt text (one image token per image), its ids (each image token repeated per
    embedding) and the images, in order."""
    spec, processor = state.vision, state.image_processor()
    try:
        shaped, images = take_images(messages, spec.max_images)
        processed = []
        for item in images:
            try:
                processed.append(processor.preprocess(item.image))
            except ValueError as error:
                raise ContentImageError(item.param, str(error)) from None
    except ContentImageError as error:
        raise APIError(400, str(error), param=error.param, code="invalid_image") from None
    text, ids = chat_prompt(state.client.tokenizer, body, tools, shaped)
    try:
        ids, inputs = expand_placeholders(ids, processed, spec.image_token_id)
    except ImageError as error:
        raise bad_request(str(error), "messages") from None
    return text, ids, inputs
