"""Gemma 3 with images through the whole engine matches transformers (fp32, a tiny random model,
images of different sizes): the image processor's pixels, the SigLIP tower and projector, logits
and greedy ids with the bidirectional attention among an image's tokens, a chunked prefill whose
chunk boundary would fall inside an image, a prefix hit inside an image, and preemption.

transformers gets the pixels fw's processor made (which equal its own ``Gemma3ImageProcessorPil``'s)
and the ``token_type_ids`` its processor sends (1 on image tokens), which switch on its mask.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from fw_gemma.gemma3_processor import Gemma3ImageProcessor

from framework import LLM, SamplingParams
from framework.errors import ConfigError
from framework.testing import (
    VisionReference,
    capture_logits,
    check_image_request,
    check_preempted_image_requests,
    gemma3_inputs,
    image_chat,
    random_image,
    write_tiny_gemma3,
)
from framework.testing.vision import IMAGE_TOKEN_ID
from framework.testing.vision_gemma3 import GEMMA3_SPECIALS

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BOI, EOI = GEMMA3_SPECIALS["<start_of_image>"], GEMMA3_SPECIALS["<end_of_image>"]
SPAN = [BOI] + [IMAGE_TOKEN_ID] * 16 + [EOI]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3")
    return path, write_tiny_gemma3(path)


@pytest.fixture(scope="module")
def processor(tiny):
    from fw_gemma.gemma3_vl import Gemma3ForConditionalGeneration

    from framework.config import ModelConfig

    path = tiny[0]
    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()), dtype=torch.float32)
    preprocessor = json.loads((path / "preprocessor_config.json").read_text())
    return Gemma3ImageProcessor(Gemma3ForConditionalGeneration.vision_spec(config, preprocessor).processor_config)


@pytest.fixture(scope="module")
def reference(tiny, processor):
    return VisionReference(tiny[1], functools.partial(gemma3_inputs, processor))


def record_steps(llm, numbered=False):
    """Every scheduled ``(request id, first position, tokens)`` (``numbered``: with its step's
    index first), in order."""
    scheduler = llm.engine.core.scheduler
    schedule, steps, count = scheduler.schedule, [], iter(range(10**6))

    def recording():
        batch, index = schedule(), next(count)
        steps.extend(
            (index,) * numbered + (r.request_id, r.num_computed_tokens, n)
            for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)
        )
        return batch

    scheduler.schedule = recording
    return steps


def test_image_processor_matches_transformers_pil_processor(processor, tiny):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    settings = json.loads((tiny[0] / "preprocessor_config.json").read_text())
    settings.pop("image_processor_type")
    reference = Gemma3ImageProcessorPil(**settings)
    # scaled up, scaled down, a tall one: every image is the tower's 56 x 56
    for image in (random_image(30, 20, 1), random_image(300, 130, 2), random_image(20, 90, 3)):
        expected = reference(images=[image], return_tensors="np")["pixel_values"][0]
        ours = processor.preprocess(image)
        assert ours.pixel_values.shape == (3, 56, 56) and ours.grid == [8, 8]
        np.testing.assert_allclose(ours.pixel_values, expected, rtol=0, atol=1e-6)
        assert ours.span_ids == SPAN and ours.num_tokens == 18 == processor.num_tokens(image.width, image.height)


def test_vision_tower_and_projector_match_transformers(tiny, processor):
    path, hf_model = tiny
    model = LLM(str(path), dtype="float32", device="cpu", num_blocks=8).engine.core.runner.model
    pixels = torch.from_numpy(processor.preprocess(random_image(84, 56, 1)).pixel_values)
    with torch.no_grad():
        got = model.embed_image(pixels, [8, 8])
        expected = hf_model.model.get_image_features(pixels[None]).pooler_output[0]
    assert got.shape == (16, 64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_two_images_in_prefill_chunks_of_8_match_transformers_and_no_chunk_splits_an_image(tiny, reference):
    llm = LLM(str(tiny[0]), dtype="float32", device="cpu", prefill_chunk_size=8)
    logits, steps = capture_logits(llm), record_steps(llm)
    images = [random_image(84, 56, 1), random_image(40, 120, 2)]
    result = llm.chat(image_chat(*images), GREEDY)[0]
    prompt = result.prompt_token_ids
    first = prompt.index(BOI)
    assert prompt[first : first + 18] == SPAN and prompt.count(IMAGE_TOKEN_ID) == 32
    # the image tokens 5..20 and 24..39: a chunk of 8 from 0 would end inside the first; none does
    assert (first, prompt.index(BOI, first + 1)) == (4, 23)
    prefill = [(start, n) for request, start, n in steps if start < len(prompt)]
    assert prefill == [(0, 5), (5, 16), (21, 3), (24, 16), (40, 4)]
    check_image_request(logits, "0-0", result, reference, images, GREEDY.max_tokens)
    assert llm.engine.core.runner.multimodal.num_encoder_runs == 2
    sequence = prompt + result.outputs[0].token_ids[:-1]
    with torch.no_grad():  # the mask matters: a causal one gives other logits
        causal = reference.model(**{**reference.inputs(sequence, images), "token_type_ids": None}).logits[0]
    assert (causal - reference.logits(sequence, images)).abs().amax() > 1e-2


def test_an_image_the_budget_cannot_hold_whole_waits_and_both_requests_match_transformers(tiny, reference):
    llm = LLM(str(tiny[0]), dtype="float32", device="cpu", prefill_chunk_size=8, max_num_batched_tokens=18)
    steps = record_steps(llm, numbered=True)
    images = [random_image(84, 56, 1), random_image(40, 120, 2)]
    results = llm.chat([image_chat(*images), image_chat(images[1], text="t9")], GREEDY)
    second = [(index, start, n) for index, request, start, n in steps if request == "1-0"]
    # steps 1-4 leave less than 16 of the budget beside the first request's chunks (16, 3, 16, 4
    # tokens): the second's image waits, running, until step 5's decode leaves it 17
    assert second[:2] == [(0, 0, 4), (5, 4, 16)]
    assert [(i, start, n) for i, request, start, n in steps if request == "0-0" and 1 <= i <= 5] == [
        (1, 5, 16),
        (2, 21, 3),
        (3, 24, 16),
        (4, 40, 4),
        (5, 44, 1),
    ]
    for result, used in zip(results, (images, images[1:]), strict=True):
        assert result.outputs[0].token_ids == reference.greedy(result.prompt_token_ids, used, GREEDY.max_tokens)


def test_a_prefix_hit_inside_an_image_continues_to_its_end_and_matches_transformers(tiny, reference):
    # blocks and chunks of 4; the hit covers tokens 0..11, inside the image tokens 7..22. Not
    # check_prefix_hit_inside_an_image, which builds its engine inside, where no steps are recorded
    llm = LLM(
        str(tiny[0]), dtype="float32", device="cpu", block_size=4, prefill_chunk_size=4, prefix_cache_max_tokens=12
    )
    logits, steps = capture_logits(llm), record_steps(llm)
    image = random_image(64, 64, 5)
    llm.chat(image_chat(image, text="t5 t6 t7 t8"), GREEDY)
    second = llm.chat(image_chat(image, text="t5 t6 t7 t8"), GREEDY)[0]
    assert second.prompt_token_ids.index(BOI) == 6 and second.num_cached_tokens == 12
    assert ("1-0", 12, 11) in steps  # from the hit to the image's end in one step, past the chunk size
    check_image_request(logits, "1-0", second, reference, [image], GREEDY.max_tokens, decoded=False, first=12)


def test_preempted_requests_with_images_resume_without_encoding_again(tiny, reference):
    images = [random_image(40 + 30 * i, 56, 10 + i) for i in range(3)]
    check_preempted_image_requests(tiny[0], reference, images, num_blocks=6, max_tokens=16)


def test_an_image_longer_than_the_token_budget_is_refused_naming_the_setting(tiny, processor):
    llm = LLM(str(tiny[0]), dtype="float32", device="cpu", max_num_batched_tokens=12, prefill_chunk_size=12)
    with pytest.raises(ConfigError, match="an image takes 16 tokens .* max_num_batched_tokens is 12"):
        llm.chat(image_chat(random_image(56, 56, 1)), GREEDY)


def test_engine_summary_and_spec_name_the_gemma3_processor_and_placeholder(tiny):
    llm = LLM(str(tiny[0]), dtype="float32", device="cpu", num_blocks=8)
    vision = llm.engine.vision
    assert (vision.image_token_id, vision.placeholder_token_id, vision.layout_token_ids) == (
        IMAGE_TOKEN_ID,
        BOI,
        [BOI, EOI],
    )
    assert llm.engine.summary["vision"]["image_processor"] == "Gemma3ImageProcessor"
    layers = [layer.self_attn.attn.config for layer in llm.engine.core.runner.model.model.layers]
    assert all(layer.has_bidirectional_spans for layer in layers) and layers[0].sliding_window == 6


def test_pan_and_scan_is_refused_with_the_setting_to_change(tiny):
    from fw_gemma.gemma3_vl import Gemma3ForConditionalGeneration

    from framework.config import ModelConfig

    config = ModelConfig.from_hf_config(json.loads((tiny[0] / "config.json").read_text()), dtype=torch.float32)
    with pytest.raises(ConfigError, match="pan-and-scan .* set do_pan_and_scan to false"):
        Gemma3ForConditionalGeneration.vision_spec(config, {"do_pan_and_scan": True})


@pytest.mark.gpu
def test_greedy_ids_match_transformers_on_cuda_with_the_triton_backend(tiny, reference):
    llm = LLM(str(tiny[0]), dtype="float32", device="cuda", prefill_chunk_size=8, attention_backend="triton")
    images = [random_image(84, 56, 1), random_image(40, 120, 2)]
    results = llm.chat([image_chat(*images), image_chat(images[1], text="t9")], GREEDY)
    for result, used in zip(results, (images, images[1:]), strict=True):
        assert result.outputs[0].token_ids == reference.greedy(result.prompt_token_ids, used, GREEDY.max_tokens)
