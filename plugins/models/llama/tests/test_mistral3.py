"""Mistral 3 (Pixtral tower) through the whole engine matches transformers (fp32, a tiny random
model, images of different sizes): the image processor's pixels, the tower at a non-square grid,
logits and greedy ids with a chunked prefill that splits an image's span (its ``[IMG_BREAK]`` /
``[IMG_END]`` layout tokens included), a prefix hit inside a span, preemption, the older checkpoint
names, and the refusal of a span laid out wrongly.

transformers gets the pixels fw's processor made (which equal its own ``PixtralImageProcessorPil``'s),
zero-padded to one batch with their ``image_sizes``, as its processor sends them.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from fw_llama.pixtral_processor import PixtralImageProcessor, processor_settings

from framework import LLM, SamplingParams
from framework.errors import ConfigError
from framework.multimodal.inputs import ImageInput
from framework.testing import (
    VisionReference,
    capture_logits,
    check_image_request,
    check_preempted_image_requests,
    check_prefix_hit_inside_an_image,
    check_text_only_prompt,
    engine_logits,
    image_chat,
    random_image,
    write_tiny_mistral3,
)
from framework.testing.vision import IMAGE_TOKEN_ID, MISTRAL3_SPECIALS

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
BREAK, END = MISTRAL3_SPECIALS["[IMG_BREAK]"], MISTRAL3_SPECIALS["[IMG_END]"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mistral3")
    return path, write_tiny_mistral3(path)


@pytest.fixture(scope="module")
def processor(tiny):
    settings = processor_settings(json.loads((tiny[0] / "preprocessor_config.json").read_text()))
    settings.update(image_token_id=IMAGE_TOKEN_ID, image_break_token_id=BREAK, image_end_token_id=END)
    return PixtralImageProcessor(settings)


def reference_inputs(processor, ids, images) -> dict:
    """transformers' inputs: ``pixel_values`` (padded to the largest image) and ``image_sizes``."""
    processed = [processor.preprocess(image).pixel_values for image in images]
    height, width = max(p.shape[1] for p in processed), max(p.shape[2] for p in processed)
    padded = [np.pad(p, ((0, 0), (0, height - p.shape[1]), (0, width - p.shape[2]))) for p in processed]
    return dict(
        input_ids=torch.tensor([ids]),
        pixel_values=torch.from_numpy(np.stack(padded)),
        image_sizes=torch.tensor([list(p.shape[1:]) for p in processed]),
    )


@pytest.fixture(scope="module")
def reference(tiny, processor):
    return VisionReference(tiny[1], functools.partial(reference_inputs, processor))


def test_image_processor_matches_transformers_pil_processor(processor, tiny):
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    settings = json.loads((tiny[0] / "preprocessor_config.json").read_text())
    settings.pop("image_processor_type")
    reference = PixtralImageProcessorPil(**settings)
    # a small image (rounded up), one scaled down to the longest edge, a tall one
    for image in (random_image(84, 56, 1), random_image(300, 130, 2), random_image(20, 90, 3)):
        expected = reference(images=[image], patch_size=28, return_tensors="np")  # patch * merge, as PixtralProcessor
        ours = processor.preprocess(image)
        np.testing.assert_allclose(ours.pixel_values, expected["pixel_values"][0], rtol=0, atol=1e-6)
        height, width = expected["image_sizes"][0]
        assert ours.grid == [height // 14, width // 14]
        rows, cols = height // 28, width // 28
        assert ours.span_ids == ([IMAGE_TOKEN_ID] * cols + [BREAK]) * (rows - 1) + [IMAGE_TOKEN_ID] * cols + [END]
        assert ours.num_tokens == len(ours.span_ids) == processor.num_tokens(image.width, image.height)


def test_vision_tower_and_projector_match_transformers_at_a_non_square_grid(tiny, processor):
    path, reference = tiny
    llm = LLM(str(path), dtype="float32", device="cpu")
    model = llm.engine.core.runner.model
    image = processor.preprocess(random_image(100, 60, 4))
    assert image.grid == [6, 8]  # 3 x 4 merged blocks
    pixels = torch.from_numpy(image.pixel_values)
    with torch.no_grad():
        got = model.embed_image(pixels, image.grid)
        expected = reference.model.get_image_features(pixels[None], image_sizes=torch.tensor([[84, 112]]))
    torch.testing.assert_close(got, expected.pooler_output[0], rtol=1e-5, atol=1e-5)


def test_logits_and_greedy_ids_match_transformers_with_two_images_split_by_chunked_prefill(tiny, reference):
    path, _ = tiny
    llm = LLM(str(path), dtype="float32", device="cpu", prefill_chunk_size=8)
    logits = capture_logits(llm)
    images = [random_image(84, 56, 1), random_image(60, 100, 2)]  # 2 x 3 and 4 x 3 merged blocks
    result = llm.chat(image_chat(*images), GREEDY)[0]
    prompt = result.prompt_token_ids
    first = prompt.index(IMAGE_TOKEN_ID)
    span = prompt[first : first + 8]
    assert span == [IMAGE_TOKEN_ID] * 3 + [BREAK] + [IMAGE_TOKEN_ID] * 3 + [END]
    assert first // 8 != (first + 7) // 8  # the first image's span crosses a chunk boundary
    assert prompt.count(IMAGE_TOKEN_ID) == 6 + 12 and prompt.count(BREAK) == 1 + 3 and prompt.count(END) == 2
    check_image_request(logits, "0-0", result, reference, images, GREEDY.max_tokens)
    assert llm.engine.core.runner.multimodal.num_encoder_runs == 2  # each image once, though split over steps


def test_a_prefix_hit_inside_the_span_and_a_chunk_holding_only_its_end_token_match_transformers(tiny, reference):
    # blocks and chunks of 4; the hit covers tokens 0..7; the 4 x 4 image's 20-token span starts at 5
    image, span = random_image(112, 112, 5), (IMAGE_TOKEN_ID, 20)
    _, second = check_prefix_hit_inside_an_image(
        tiny[0], reference, image, GREEDY, span, 8, text="t5 t6 t7 t8", prefill_chunk_size=4
    )
    start = second.prompt_token_ids.index(IMAGE_TOKEN_ID)
    assert second.prompt_token_ids[start + 19] == END and (start + 19) % 4 == 0  # its chunk has no image token


def test_preempted_requests_with_images_resume_without_encoding_again(tiny, reference):
    # spans of 6, 8 and 10 tokens: prompts of 11, 13 and 15 tokens that grow past 2 blocks each
    images = [random_image(56 + 28 * i, 56, 10 + i) for i in range(3)]
    check_preempted_image_requests(tiny[0], reference, images, num_blocks=6, max_tokens=20)


def test_text_only_prompt_matches_transformers(tiny, reference):
    llm = LLM(str(tiny[0]), dtype="float32", device="cpu")
    check_text_only_prompt(llm, reference, [290, 5, 6, 7, 291, 8], GREEDY)


def test_checkpoints_with_the_older_tensor_names_load_the_same_model(tiny, reference, tmp_path):
    """``language_model.model.*``, ``language_model.lm_head``, ``vision_tower.*`` and
    ``multi_modal_projector.*`` (Mistral Small 3.1's files) give the same logits."""
    import shutil

    from safetensors.torch import load_file, save_file

    path, _ = tiny
    for file in path.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, tmp_path / file.name)
    renames = (
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )
    tensors = load_file(path / "model.safetensors")
    old = {}
    for name, tensor in tensors.items():
        new = next((after + name.removeprefix(before) for before, after in renames if name.startswith(before)), name)
        old[new] = tensor
    assert not any(name.startswith("model.") for name in old)
    save_file(old, tmp_path / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(tmp_path), dtype="float32", device="cpu")
    logits = capture_logits(llm)
    image = random_image(84, 56, 1)
    prompt = llm.chat(image_chat(image), SamplingParams(temperature=0, max_tokens=1))[0].prompt_token_ids
    got = engine_logits(logits, "0-0", range(len(prompt)))
    torch.testing.assert_close(got, reference.logits(prompt, [image]), rtol=1e-4, atol=1e-4)


def test_engine_refuses_a_span_without_its_layout_tokens(tiny, processor):
    path, _ = tiny
    llm = LLM(str(path), dtype="float32", device="cpu")
    processed = processor.preprocess(random_image(56, 56, 1))  # 2 x 2 blocks: a span of 6 tokens
    pixels = processed.pixel_values
    image = ImageInput(pixel_values=pixels.tobytes(), shape=list(pixels.shape), grid=processed.grid, offset=1, length=6)
    with pytest.raises(ConfigError, match=r"image 0: its span is not the image token 294 laid out with .*\[292, 293\]"):
        llm.engine.core.add_request("r", [5] + [IMAGE_TOKEN_ID] * 6 + [6], GREEDY, images=[image])
    span = processed.span_ids
    llm.engine.core.add_request("ok", [5, *span, 6], GREEDY, images=[image])  # the laid-out span is taken


def test_a_config_without_layout_ids_takes_mistral_3s_tokenizer_ids(tiny):
    """Released configs name only ``image_token_index``; their tekken tokenizers put ``[IMG]``,
    ``[IMG_BREAK]`` and ``[IMG_END]`` at 10, 12 and 13."""
    from fw_llama.mistral3 import Mistral3ForConditionalGeneration

    from framework.config import ModelConfig

    hf = json.loads((tiny[0] / "config.json").read_text())
    for key in ("image_break_token_id", "image_end_token_id"):
        hf.pop(key)
    hf["image_token_index"] = 10
    config = ModelConfig.from_hf_config(hf, dtype=torch.float32)
    # Mistral Small 3.1's preprocessor_config.json (its settings that fw reads)
    spec = Mistral3ForConditionalGeneration.vision_spec(config, {"patch_size": 14, "size": {"longest_edge": 1540}})
    assert (spec.image_token_id, spec.layout_token_ids) == (10, [12, 13])
    image = PixtralImageProcessor(spec.processor_config).preprocess(random_image(2000, 1000, 1))
    assert image.pixel_values.shape == (3, 784, 1540) and image.span_ids[54:56] == [10, 12]  # 28 rows of 55
    assert image.span_ids.count(10) == 28 * 55 and image.span_ids[-1] == 13


def test_a_text_model_this_class_does_not_serve_is_refused_naming_those_it_does(tiny):
    from fw_llama.mistral3 import text_config

    from framework.config import ModelConfig

    hf = json.loads((tiny[0] / "config.json").read_text())
    hf["text_config"]["model_type"] = "ministral3"  # Ministral 3: Llama 4 attention scaling, not built
    config = ModelConfig.from_hf_config(hf, dtype=torch.float32)
    with pytest.raises(ConfigError, match="a 'ministral3' text model is not supported; supported: mistral, llama"):
        text_config(config)


def test_engine_summary_names_the_pixtral_processor(tiny):
    llm = LLM(str(tiny[0]), dtype="float32", device="cpu")
    assert llm.engine.vision.layout_token_ids == [BREAK, END]
    assert llm.engine.summary["vision"]["image_processor"] == "PixtralImageProcessor"


@pytest.mark.gpu
def test_greedy_ids_match_transformers_on_cuda_with_graphs(tiny, reference):
    path, _ = tiny
    llm = LLM(str(path), dtype="float32", device="cuda", prefill_chunk_size=8, async_scheduling=True)
    images = [random_image(84, 56, 1), random_image(60, 100, 2)]
    results = llm.chat([image_chat(*images), image_chat(images[1], text="t9")], GREEDY)
    for result, used in zip(results, [images, images[1:]], strict=True):
        assert result.outputs[0].token_ids == reference.greedy(result.prompt_token_ids, used, GREEDY.max_tokens)
    assert llm.engine.core.runner.graph_runner is not None
