"""Llama 4 with images through the whole engine matches transformers (fp32, a tiny random model,
32-pixel tiles of 8-pixel patches, canvases of up to 4 tiles): the image processor's canvas, tiles,
thumbnail and bfloat16 pixels against transformers' ``Llama4ImageProcessor`` and its span against
``Llama4Processor``'s layout; the vision model and projector on a canvas of four tiles; logits and
greedy ids with a chunked prefill that splits a multi-tile span, a prefix hit inside a span,
preemption, and text alone.

transformers 5.24's ``Llama4ForConditionalGeneration.forward`` reads ``image_outputs`` from its
language model's output, which has none (5.23 did not); the ``reference_forward`` fixture gives
that output class the attribute (None) for the test, the one-line patch transformers needs.
"""

from __future__ import annotations

import importlib
import json
import sys
import types

import numpy as np
import pytest
import torch
from fw_llama.llama4_processor import Llama4ImageProcessor

from framework import LLM, SamplingParams
from framework.testing import (
    LLAMA4_SPECIALS,
    VisionReference,
    capture_logits,
    check_image_request,
    check_preempted_image_requests,
    check_prefix_hit_inside_an_image,
    check_text_only_prompt,
    image_chat,
    random_image,
    write_tiny_llama4,
)
from framework.testing.vision import IMAGE_TOKEN_ID

pytestmark = pytest.mark.usefixtures("one_thread", "reference_forward")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
START, END, IMAGE = (LLAMA4_SPECIALS[k] for k in ("<|image_start|>", "<|image_end|>", "<|image|>"))
TILE_X, TILE_Y = LLAMA4_SPECIALS["<|tile_x_separator|>"], LLAMA4_SPECIALS["<|tile_y_separator|>"]
#: a one-tile image (7 span tokens), a 1 x 2 canvas (3 tiles with the thumbnail: 17), a 2 x 2 one (5 tiles: 27)
IMAGES = {"one": (30, 20, 1), "wide": (60, 30, 2), "four": (70, 40, 3)}


@pytest.fixture
def reference_forward(monkeypatch):
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    monkeypatch.setattr(MoeCausalLMOutputWithPast, "image_outputs", None, raising=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama4")
    return path, write_tiny_llama4(path)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny[0]), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def processor(llm):
    return Llama4ImageProcessor(llm.engine.vision.processor_config)


def image(name):
    return random_image(*IMAGES[name])


def pixels(processor, images):
    """transformers' ``pixel_values``: every image's tiles, concatenated."""
    return torch.from_numpy(np.concatenate([processor.preprocess(picture).pixel_values for picture in images]))


@pytest.fixture(scope="module")
def reference(tiny, processor):
    return VisionReference(
        tiny[1], lambda ids, images: dict(input_ids=torch.tensor([ids]), pixel_values=pixels(processor, images))
    )


def transformers_image_processor(monkeypatch):
    """transformers' ``Llama4ImageProcessor._preprocess`` bound to a stand-in of its torchvision
    backend (torchvision is not installed here): resize is torch's antialiased bilinear
    ``interpolate`` on uint8 (the kernel torchvision runs on CPU), pad and normalize are
    torchvision's arithmetic (zero fill; ``(x - mean) / std`` in the image's dtype). Canvas
    choice, upscale limit, padding, bfloat16 rescale and normalization, tiling and the thumbnail
    are transformers' own code."""
    import torch.nn.functional as F

    functional = types.ModuleType("torchvision.transforms.v2.functional")

    def pad(images, padding, fill):
        assert list(padding[:2]) == [0, 0] and not any(fill)
        return F.pad(images, (0, padding[2], 0, padding[3]))

    functional.pad = pad
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, functional.__name__, functional)
    monkeypatch.delitem(sys.modules, "transformers.models.llama4.image_processing_llama4", raising=False)
    from transformers.image_utils import SizeDict

    # the file itself: the lazy package would hand out a placeholder for a module whose backend is missing
    module = importlib.import_module("transformers.models.llama4.image_processing_llama4")

    def normalize(images, mean, std):
        mean, std = (torch.as_tensor(v, dtype=images.dtype)[:, None, None] for v in (mean, std))
        return images.sub(mean).div(std)

    def resize(images, size, resample):
        return F.interpolate(images, (size.height, size.width), mode="bilinear", antialias=True)

    methods = module.Llama4ImageProcessor.__dict__  # its methods, called on the stand-in backend
    backend = types.SimpleNamespace(resize=resize, normalize=normalize)
    backend.rescale_and_normalize = types.MethodType(methods["rescale_and_normalize"], backend)

    def run(picture, tile, max_patches):
        uint8 = torch.from_numpy(np.asarray(picture).copy()).permute(2, 0, 1)
        out = methods["_preprocess"](
            backend, [uint8], True, SizeDict(height=tile, width=tile), 2, True, 1 / 255, True,
            [0.5] * 3, [0.5] * 3, max_patches, False, None, None,
        )  # fmt: skip
        return out["pixel_values"][0].float().numpy(), out["aspect_ratios"][0].tolist()

    return run


def test_image_processor_matches_transformers_processor_and_layout(processor, tiny, monkeypatch):
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    from framework.tokenizer import Tokenizer

    settings = json.loads((tiny[0] / "preprocessor_config.json").read_text())
    assert settings["size"] == {"height": 32, "width": 32} and settings["max_patches"] == 4
    reference = transformers_image_processor(monkeypatch)
    tokenizer = Tokenizer.from_directory(tiny[0])
    # exact sizes (no resize), upscaled, padded, downscaled onto 2 x 2 tiles, tall onto 3 x 1
    cases = [(32, 32, 4), *IMAGES.values(), (20, 90, 5), (100, 100, 6)]
    for width, height, seed in cases:
        picture = random_image(width, height, seed)
        expected, ratio = reference(picture, 32, 4)
        ours = processor.preprocess(picture)
        assert ours.grid == ratio and ours.pixel_values.shape == expected.shape
        diff = np.abs(ours.pixel_values - expected)
        # Pillow's and torch's antialiased bilinear differ by one level on a few pixels (2/255 once
        # normalized), each side then rounded to bfloat16 (at most 2**-8 each below 1)
        assert diff.max() <= 2 / 255 + 2**-7 and diff.mean() < 1e-3, (width, height, diff.max())
        if (width, height) == (32, 32):
            assert diff.max() == 0  # no resize: transformers' bfloat16 normalization, bit for bit
        layout = Llama4Processor._prompt_split_image(None, ratio, 4)
        assert ours.span_ids == tokenizer.encode(layout, add_special_tokens=False)
        assert ours.num_tokens == len(ours.span_ids) == processor.num_tokens(width, height)


def test_vision_model_and_projector_match_transformers_on_four_tiles_and_a_thumbnail(tiny, llm, processor):
    _, reference = tiny
    model = llm.engine.core.runner.model
    processed = processor.preprocess(image("four"))
    assert processed.grid == [2, 2] and processed.pixel_values.shape == (5, 3, 32, 32)
    tiles = torch.from_numpy(processed.pixel_values)
    with torch.no_grad():
        got = model.embed_image(tiles, processed.grid)
        features = reference.get_image_features(tiles).last_hidden_state
        expected = reference.multi_modal_projector(features.flatten(0, 1))
    assert got.shape == (5 * 4, 64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_logits_and_greedy_ids_match_transformers_with_two_images_split_by_chunked_prefill(tiny, reference):
    path, _ = tiny
    llm = LLM(str(path), dtype="float32", device="cpu", prefill_chunk_size=8)
    logits = capture_logits(llm)
    images = [image("one"), image("four")]
    result = llm.chat(image_chat(*images), GREEDY)[0]
    prompt = result.prompt_token_ids
    first = prompt.index(START)
    assert prompt[first : first + 7] == [START, IMAGE, *[IMAGE_TOKEN_ID] * 4, END]
    second = prompt.index(START, first + 1)
    span = prompt[second : second + 27]
    assert (
        span[5:6] == [TILE_X] and span[10:11] == [TILE_Y] and span[-7:] == [TILE_Y, IMAGE, *[IMAGE_TOKEN_ID] * 4, END]
    )
    assert second // 8 != (second + 26) // 8  # the four-tile span crosses chunk boundaries
    assert prompt.count(IMAGE_TOKEN_ID) == 4 + 5 * 4
    check_image_request(logits, "0-0", result, reference, images, GREEDY.max_tokens)
    assert llm.engine.core.runner.multimodal.num_encoder_runs == 2  # each image once, though split over steps


def test_a_prefix_hit_inside_a_span_matches_transformers(tiny, reference):
    # blocks and chunks of 4; the hit covers tokens 0..11, inside the 17-token span of the wide image
    llm, _ = check_prefix_hit_inside_an_image(
        tiny[0], reference, image("wide"), GREEDY, (START, 17), 12, prefill_chunk_size=4
    )
    assert llm.engine.core.runner.multimodal.num_encoder_runs == 2  # once per request


def test_preempted_requests_with_images_resume_without_encoding_again(tiny, reference):
    # prompts of 17, 27 and 37 tokens that grow to 3, 3 and 4 blocks; 8 blocks do not hold all three
    images = [image("one"), image("wide"), image("four")]
    check_preempted_image_requests(tiny[0], reference, images, num_blocks=8, max_tokens=16)


def test_engine_refuses_a_span_without_its_layout_and_tiles_that_are_not_its_canvas(tiny, processor):
    from framework.errors import ConfigError
    from framework.multimodal.inputs import ImageInput

    llm = LLM(str(tiny[0]), dtype="float32", device="cpu")

    processed = processor.preprocess(image("wide"))  # 1 x 2 tiles + the thumbnail: 17 span tokens
    tiles = processed.pixel_values
    item = ImageInput(pixel_values=tiles.tobytes(), shape=list(tiles.shape), grid=processed.grid, offset=1, length=17)
    core = llm.engine.core
    with pytest.raises(ConfigError, match=rf"image 0: its span is not the image token {IMAGE_TOKEN_ID} laid out"):
        core.add_request("plain", [5] + [IMAGE_TOKEN_ID] * 17 + [6], GREEDY, images=[item])
    with pytest.raises(ConfigError, match=r"pixels of shape \[3, 3, 32, 32\] are not the 5 tiles .* canvas \[2, 2\]"):
        llm.engine.core.runner.model.embed_image(torch.from_numpy(tiles), [2, 2])
    core.add_request("ok", [5, *processed.span_ids, 6], GREEDY, images=[item])  # the laid-out span is taken


def test_text_only_prompt_matches_transformers(llm, reference):
    check_text_only_prompt(llm, reference, [290, 5, 6, 7, 291, 8], GREEDY)


def test_a_released_config_takes_llama_4s_tokenizer_ids_and_its_tile_size(tiny):
    """Released configs name ``boi`` / ``eoi`` / ``image_token_index`` only; the tile separators and
    ``<|image|>`` are the Llama 4 tokenizer's 200084, 200085 and 200090."""
    from fw_llama.llama4_vl import Llama4ForConditionalGeneration

    from framework.config import ModelConfig
    from framework.errors import ConfigError

    hf = json.loads((tiny[0] / "config.json").read_text())
    for key in ("tile_x_separator_token_id", "tile_y_separator_token_id", "image_placeholder_token_id"):
        hf.pop(key)
    hf.update(boi_token_index=200080, eoi_token_index=200081, image_token_index=200092)
    hf["vision_config"].update(image_size=336, patch_size=14)
    config = ModelConfig.from_hf_config(hf, dtype=torch.float32)
    # Llama 4 Scout's preprocessor_config.json (the settings fw reads)
    scout = {"size": {"height": 336, "width": 336}, "max_patches": 16, "resample": 2}
    spec = Llama4ForConditionalGeneration.vision_spec(config, scout)
    assert (spec.image_token_id, spec.placeholder_token_id) == (200092, 200090)
    assert spec.layout_token_ids == [200080, 200084, 200085, 200090, 200081]
    processed = Llama4ImageProcessor(spec.processor_config).preprocess(random_image(1000, 500, 1))
    # the least upscale: 2 x 3 tiles of 336 (x 1.008); 144 embeddings per tile after the shuffle
    assert processed.grid == [2, 3] and processed.pixel_values.shape == (7, 3, 336, 336)
    assert processed.num_tokens == 1 + 2 * (3 * 144 + 3) + 1 + 144 + 1
    with pytest.raises(ConfigError, match="tiles of 448 pixels do not match the vision model's image_size 336"):
        Llama4ForConditionalGeneration.vision_spec(config, {"size": {"height": 448, "width": 448}})


def test_engine_summary_names_the_llama4_processor(llm):
    assert llm.engine.vision.layout_token_ids == [START, TILE_X, TILE_Y, IMAGE, END]
    assert llm.engine.summary["vision"]["image_processor"] == "Llama4ImageProcessor"


@pytest.mark.gpu
def test_greedy_ids_match_transformers_on_cuda_with_graphs(tiny, reference):
    path, _ = tiny
    llm = LLM(str(path), dtype="float32", device="cuda", prefill_chunk_size=8, async_scheduling=True)
    images = [image("one"), image("four")]
    results = llm.chat([image_chat(*images), image_chat(images[1], text="t9")], GREEDY)
    for result, used in zip(results, [images, images[1:]], strict=True):
        assert result.outputs[0].token_ids == reference.greedy(result.prompt_token_ids, used, GREEDY.max_tokens)
    assert llm.engine.core.runner.graph_runner is not None
