"""Image decoding and placeholder expansion of ``framework.multimodal`` (no model): every accepted
format decodes to the same RGB pixels, transparency lands on white, limits and mismatches are refused."""

from __future__ import annotations

import numpy as np
import pytest

from framework.multimodal import images
from framework.multimodal.images import ImageError, decode_image_url
from framework.multimodal.inputs import ProcessedImage
from framework.multimodal.prompt import expand_placeholders
from framework.testing import data_url, random_image


@pytest.mark.parametrize("image_format", ["PNG", "WEBP", "BMP", "GIF"])
def test_lossless_formats_decode_to_the_same_rgb_pixels(image_format):
    image = random_image(23, 17, 4)
    if image_format == "GIF":  # a palette format: compare with what the palette keeps
        image = image.quantize(64).convert("RGB")
    decoded = decode_image_url(data_url(image, image_format) if image_format != "WEBP" else _lossless_webp(image))
    assert decoded.mode == "RGB" and decoded.size == (23, 17)
    np.testing.assert_array_equal(np.asarray(decoded), np.asarray(image))


def _lossless_webp(image) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="WEBP", lossless=True)
    return "data:image/webp;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_jpeg_decodes_to_rgb():
    decoded = decode_image_url(data_url(random_image(30, 20, 1), "JPEG"))
    assert decoded.mode == "RGB" and decoded.size == (30, 20)


def test_transparent_pixels_are_composited_onto_white():
    from PIL import Image

    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    decoded = np.asarray(decode_image_url(data_url(rgba)))
    assert decoded[0, 0].tolist() == [10, 20, 30] and decoded[3, 3].tolist() == [255, 255, 255]


def test_an_image_over_the_pixel_limit_is_refused(monkeypatch):
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ImageError, match="the image has 20x10 pixels; at most 100 are read"):
        decode_image_url(data_url(random_image(20, 10, 0)))


def test_placeholders_expand_to_each_images_tokens_and_a_count_mismatch_is_refused():
    pixels = np.zeros((8, 3), dtype=np.float32)
    processed = [ProcessedImage(pixels, [1, 4, 2], 2), ProcessedImage(pixels[:4], [1, 2, 2], 1)]
    ids, inputs = expand_placeholders([5, 9, 6, 9, 7], processed, image_token_id=9)
    assert ids == [5, 9, 9, 6, 9, 7]
    assert [(i.offset, i.length, i.shape) for i in inputs] == [(1, 2, [8, 3]), (4, 1, [4, 3])]
    with pytest.raises(ImageError, match="the chat template wrote 1 image tokens for 2 images"):
        expand_placeholders([5, 9, 6], processed, image_token_id=9)


def test_a_span_with_layout_tokens_is_written_as_the_processor_laid_it_out():
    pixels = np.zeros((3, 4, 4), dtype=np.float32)
    laid_out = ProcessedImage(pixels, [2, 2], 3, [9, 9, 11])  # [IMG] [IMG] [IMG_END]
    plain = ProcessedImage(pixels, [1, 2, 2], 2)
    ids, inputs = expand_placeholders([5, 9, 6, 9, 7], [laid_out, plain], image_token_id=9, layout_token_ids=(10, 11))
    assert ids == [5, 9, 9, 11, 6, 9, 9, 7]
    assert [(i.offset, i.length) for i in inputs] == [(1, 3), (5, 2)]
    with pytest.raises(
        ImageError, match=r"span holds ids \[12\] outside the model's image and layout tokens \[9, 10, 11\]"
    ):
        expand_placeholders([5, 9], [ProcessedImage(pixels, [2, 2], 3, [9, 12, 11])], 9, (10, 11))
    with pytest.raises(ImageError, match="a span of 2 ids for 3 tokens"):
        expand_placeholders([5, 9], [ProcessedImage(pixels, [2, 2], 3, [9, 11])], 9, (10, 11))


def test_a_placeholder_other_than_the_image_token_is_replaced_by_the_span_that_may_hold_it():
    """Llama 4: the template writes ``<|image|>`` (12); the span holds it again before the
    thumbnail's ``<|patch|>`` (9) tokens."""
    pixels = np.zeros((1, 3, 4, 4), dtype=np.float32)
    span = [10, 12, 9, 9, 11]  # <|image_start|> <|image|> <|patch|> x 2 <|image_end|>
    processed = [ProcessedImage(pixels, [1, 1], 5, span), ProcessedImage(pixels, [1, 1], 5, span)]
    ids, inputs = expand_placeholders(
        [5, 12, 6, 12], processed, image_token_id=9, layout_token_ids=(10, 11, 12), placeholder_token_id=12
    )
    assert ids == [5, *span, 6, *span]
    assert [(i.offset, i.length) for i in inputs] == [(1, 5), (7, 5)]
    with pytest.raises(ImageError, match="the chat template wrote 0 image tokens for 2 images"):
        expand_placeholders([5, 9, 9], processed, 9, (10, 11, 12), placeholder_token_id=12)


def test_request_image_rows_skip_layout_tokens():
    import torch

    from framework.engine.multimodal_step import RequestImage

    # span at 10: [img img brk img img end] -> embeddings 0..3 at span positions 0 1 3 4
    image = RequestImage(torch.zeros(1), [2, 2], 10, 6, 0, np.array([0, 1, 3, 4]))
    at, rows = image.covered(11, 14)
    assert at.tolist() == [11, 13] and (rows.start, rows.stop) == (1, 3)
    assert image.covered(15, 20) is None  # only the end token
    assert image.covered(0, 10) is None
    whole = RequestImage(torch.zeros(1), [1, 2, 2], 10, 4, 0)
    at, rows = whole.covered(12, 30)
    assert at.tolist() == [12, 13] and (rows.start, rows.stop) == (2, 4)


def test_a_step_never_ends_inside_a_bidirectional_span():
    """Gemma 3's image tokens 5..20: a chunk stops before them, or runs through them (past the
    chunk size, within the budget; none when the budget is short); causal images are cut anywhere."""
    from types import SimpleNamespace

    import torch

    from framework.engine.multimodal_step import RequestImage, whole_span_tokens

    image = RequestImage(torch.zeros(1), [8, 8], 4, 18, 0, np.arange(1, 17), bidirectional=(5, 21))

    def wanted(start, num_new, budget=64, images=(image,)):
        return whole_span_tokens(SimpleNamespace(num_computed_tokens=start, images=list(images)), num_new, budget)

    assert wanted(0, 8) == 5  # stops before the span
    assert wanted(0, 5) == 5 and wanted(0, 3) == 3  # ends at or before its start: unchanged
    assert wanted(5, 8) == 16 and wanted(12, 4) == 9  # from its start, or a prefix hit inside it, to its end
    assert wanted(5, 8, budget=15) == 0  # the budget cannot hold it whole: wait
    assert wanted(0, 30) == 30 and wanted(21, 8) == 8  # past it: unchanged
    causal = RequestImage(torch.zeros(1), [8, 8], 4, 18, 0)
    assert wanted(0, 8, images=(causal,)) == 8
