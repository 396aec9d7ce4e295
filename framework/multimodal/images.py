"""Decoding the images of ``image_url`` content parts (API process; Pillow, no torch).

Accepted: ``data:image/<format>;base64,...`` URLs in the formats of :data:`FORMATS`, and the
``http(s)`` URLs and local paths an operator allows (:mod:`framework.multimodal.sources`). Refused,
each with an :class:`ImageError` whose message names what is accepted: other sources, other
formats, corrupt data, and images over :data:`MAX_IMAGE_BYTES` or :data:`MAX_IMAGE_PIXELS`.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

#: Pillow format names accepted, by the MIME subtype a data URL may give.
FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP", "gif": "GIF", "bmp": "BMP"}
#: The most bytes one encoded image may have, and the most pixels once decoded (Pillow's
#: decompression-bomb guard is a warning; this is a refusal).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class ImageError(ValueError):
    """An image that cannot be used; the message says why and what is accepted."""


def image_url_of(part: dict[str, Any]) -> str:
    """The URL of an OpenAI ``image_url`` content part (``{"image_url": {"url": ...}}`` or a string)."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ImageError("an image_url part needs 'image_url': {'url': 'data:image/png;base64,...'}")
    return url


def decode_image_url(url: str, sources: Any = None):
    """The RGB ``PIL.Image.Image`` of a ``data:`` URL (transparency composited on white), or of an
    ``http(s)`` URL / local path where ``sources`` (a :class:`~framework.multimodal.sources.MediaSources`,
    default: data URLs only) allow it."""
    if not url.startswith("data:"):
        from framework.multimodal.sources import DATA_URLS_ONLY, read_image_source

        return decode_image_bytes(read_image_source(url, sources or DATA_URLS_ONLY))
    header, comma, payload = url[5:].partition(",")
    mime, _, encoding = header.partition(";")
    if not comma or encoding != "base64":
        raise ImageError("a data URL must be base64-encoded: data:image/<format>;base64,<data>")
    kind, _, subtype = mime.partition("/")
    if kind != "image" or subtype.lower() not in FORMATS:
        raise ImageError(f"unsupported image type {mime!r}; supported: image/{', image/'.join(sorted(FORMATS))}")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"the image is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MiB")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data URL's base64 payload is not valid base64") from None
    return decode_image_bytes(data)


def decode_image_bytes(data: bytes):
    """The RGB image in ``data``, whose format must be one of :data:`FORMATS`."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"the image is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MiB")
    try:
        image = Image.open(io.BytesIO(data), formats=sorted(set(FORMATS.values())))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise ImageError(f"the image has {image.width}x{image.height} pixels; at most {MAX_IMAGE_PIXELS} are read")
        image.load()
    except UnidentifiedImageError:
        raise ImageError(
            f"the data is not an image in a supported format ({', '.join(sorted(set(FORMATS.values())))})"
        ) from None
    except (OSError, SyntaxError, ValueError) as error:
        if isinstance(error, ImageError):
            raise
        raise ImageError(f"the image could not be decoded ({error})") from None
    return to_rgb(image)


def to_rgb(image):
    """``image`` as RGB, any transparency composited onto white (as transformers' processors do)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
