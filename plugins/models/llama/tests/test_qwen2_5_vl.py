"""Qwen2.5-VL through the whole engine matches transformers (fp32, a tiny random model, images of
two sizes): the image processor's pixels, greedy ids with a chunked prefill that splits the images'
tokens, the prefix cache keyed by image content, preemption, and the refusals of bad image input.

transformers gets the pixels fw's processor made (which equal its own ``Qwen2VLImageProcessorPil``'s).
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from fw_llama.qwen2_vl_processor import Qwen2VLImageProcessor, processor_settings

from framework import LLM, SamplingParams
from framework.errors import ConfigError
from framework.multimodal.images import ImageError
from framework.multimodal.inputs import ImageInput
from framework.testing import (
    VisionReference,
    capture_logits,
    check_image_request,
    check_preempted_image_requests,
    check_prefix_hit_inside_an_image,
    check_text_only_prompt,
    image_chat,
    qwen_vl_inputs,
    random_image,
    randomise_identity_params,
    write_tiny_qwen2_5_vl,
)
from framework.testing.vision import IMAGE_TOKEN_ID

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2_5_vl")
    return path, write_tiny_qwen2_5_vl(path)


@pytest.fixture(scope="module")
def processor(tiny):
    return Qwen2VLImageProcessor(processor_settings(json.loads((tiny[0] / "preprocessor_config.json").read_text())))


@pytest.fixture(scope="module")
def reference(tiny, processor):
    """transformers' model, given the pixels fw's processor makes."""
    return VisionReference(tiny[1], functools.partial(qwen_vl_inputs, processor))


def test_image_processor_matches_transformers_pil_processor(processor, tiny):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    settings = json.loads((tiny[0] / "preprocessor_config.json").read_text())
    settings.pop("image_processor_type")
    reference = Qwen2VLImageProcessorPil(**settings)
    for image in (random_image(84, 56, 1), random_image(100, 130, 2), random_image(30, 20, 3).convert("RGBA")):
        expected = reference(images=[image], return_tensors="np")
        ours = processor.preprocess(image if image.mode == "RGB" else _rgb_on_white(image))
        assert ours.grid == expected["image_grid_thw"][0].tolist()
        np.testing.assert_allclose(ours.pixel_values, expected["pixel_values"], rtol=0, atol=1e-6)
        assert ours.num_tokens == np.prod(ours.grid) // 4 == processor.num_tokens(image.width, image.height)


def _rgb_on_white(image):
    from framework.multimodal.images import to_rgb

    return to_rgb(image)


def test_logits_and_greedy_ids_match_transformers_with_two_images_split_by_chunked_prefill(tiny, reference):
    path, _ = tiny
    llm = LLM(str(path), dtype="float32", device="cpu", prefill_chunk_size=8)
    logits = capture_logits(llm)
    images = [random_image(84, 56, 1), random_image(100, 120, 2)]
    result = llm.chat(image_chat(*images), GREEDY)[0]
    prompt = result.prompt_token_ids
    first = prompt.index(IMAGE_TOKEN_ID)
    assert first // 8 != (first + 5) // 8  # the first image's 6 tokens cross a chunk boundary
    assert prompt.count(IMAGE_TOKEN_ID) == 6 + 16
    # every position the engine computed, decode steps (M-RoPE index + delta) included
    check_image_request(logits, "0-0", result, reference, images, GREEDY.max_tokens)
    assert llm.engine.core.runner.multimodal.num_encoder_runs == 2  # each image once, though split over steps


def test_async_scheduling_mixes_decode_and_image_prefill_with_the_same_ids(tiny, reference):
    path, _ = tiny
    llm = LLM(str(path), dtype="float32", device="cpu", prefill_chunk_size=8, async_scheduling=True)
    logits = capture_logits(llm)
    images = [random_image(100, 120, 2)]
    # the short text-only prompt decodes (its input on the device) while the image prompt's chunks prefill
    results = llm.chat([[{"role": "user", "content": "t5"}], image_chat(*images)], GREEDY)
    assert results[0].outputs[0].token_ids == reference.greedy(results[0].prompt_token_ids, [], GREEDY.max_tokens)
    check_image_request(logits, "1-0", results[1], reference, images, GREEDY.max_tokens)  # decode positions too


def test_text_only_prompt_of_the_vision_model_matches_transformers(tiny, reference):
    llm = LLM(str(tiny[0]), dtype="float32", device="cpu")
    check_text_only_prompt(llm, reference, [290, 5, 6, 7, 291, 290, 8], GREEDY)


def test_different_images_with_the_same_text_share_no_prefix_blocks(tiny, reference):
    path, _ = tiny
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4)
    red, noise = random_image(56, 56, 7), random_image(56, 56, 8)
    first = llm.chat(image_chat(red, text="t5 t6 t7 t8 t9"), GREEDY)[0]
    image_at = first.prompt_token_ids.index(IMAGE_TOKEN_ID)
    other = llm.chat(image_chat(noise, text="t5 t6 t7 t8 t9"), GREEDY)[0]
    assert other.prompt_token_ids == first.prompt_token_ids  # the same ids: only the pixels differ
    assert other.num_cached_tokens == image_at // 4 * 4  # the text blocks before the image, no more
    assert other.outputs[0].token_ids == reference.greedy(other.prompt_token_ids, [noise], GREEDY.max_tokens)
    again = llm.chat(image_chat(red, text="t5 t6 t7 t8 t9"), GREEDY)[0]
    assert again.num_cached_tokens > image_at + 4  # the same image hits the blocks that hold it
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.core.runner.multimodal.num_encoder_runs == 2  # a hit past the image needs no encoder run


def test_a_prefix_cache_hit_that_ends_inside_an_image_continues_from_its_embeddings(tiny, reference):
    # two keyed blocks of 4: the hit covers tokens 0..7, and the image's 16 tokens start at 3
    check_prefix_hit_inside_an_image(tiny[0], reference, random_image(112, 112, 5), GREEDY, (IMAGE_TOKEN_ID, 16), 8)


def test_preempted_requests_with_images_resume_without_encoding_again(tiny, reference):
    # no prefix cache: a resumed request recomputes its image tokens, from the encoder cache
    images = [random_image(56 + 28 * i, 56, 10 + i) for i in range(3)]
    check_preempted_image_requests(tiny[0], reference, images, num_blocks=7, max_tokens=20)


def test_bad_image_input_is_refused_naming_the_part(tiny):
    path, _ = tiny
    llm = LLM(str(path), dtype="float32", device="cpu")
    corrupt = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "t5"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
            ],
        }
    ]
    with pytest.raises(ImageError, match=r"messages\[0\]\.content\[1\]: the data is not an image"):
        llm.chat(corrupt, GREEDY)
    web = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]
    with pytest.raises(
        ImageError, match=r"messages\[0\]\.content\[0\]: image URLs over http\(s\) are fetched only from"
    ):
        llm.chat(web, GREEDY)
    with pytest.raises(ImageError, match=r"content\[17\]: too many images: this model takes at most 8"):
        llm.chat(image_chat(*[random_image(56, 56, i) for i in range(9)]), GREEDY)
    assert not llm.engine.core.requests and llm.engine.core.runner.multimodal.num_encoder_runs == 0


def test_engine_refuses_images_whose_span_does_not_fit_the_prompt(tiny, processor):
    path, _ = tiny
    llm = LLM(str(path), dtype="float32", device="cpu")
    processed = processor.preprocess(random_image(56, 56, 1))
    pixels = processed.pixel_values
    image = ImageInput(pixel_values=pixels.tobytes(), shape=list(pixels.shape), grid=processed.grid, offset=1, length=3)
    with pytest.raises(ConfigError, match="image 0: its 3 placeholder tokens at 1 do not fit"):
        llm.engine.core.add_request("r", [5] + [IMAGE_TOKEN_ID] * 4 + [6], GREEDY, images=[image])


def test_text_model_refuses_images(tmp_path):
    import transformers

    from framework.testing import write_tiny_model

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    write_tiny_model(tmp_path, config, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    llm = LLM(str(tmp_path), dtype="float32", device="cpu")
    with pytest.raises(
        ConfigError, match=r"messages\[0\]\.content\[1\]: this model \(LlamaForCausalLM\) does not take images"
    ):
        llm.chat(image_chat(random_image(56, 56, 1)), GREEDY)


@pytest.mark.gpu
def test_greedy_ids_match_transformers_on_cuda_with_graphs_and_async_scheduling(tiny, reference):
    path, _ = tiny
    llm = LLM(str(path), dtype="float32", device="cuda", prefill_chunk_size=8, async_scheduling=True)
    images = [random_image(84, 56, 1), random_image(100, 120, 2)]
    results = llm.chat([image_chat(*images), image_chat(images[1], text="t9")], GREEDY)
    for result, used in zip(results, [images, images[1:]], strict=True):
        assert result.outputs[0].token_ids == reference.greedy(result.prompt_token_ids, used, GREEDY.max_tokens)
    assert llm.engine.core.runner.graph_runner is not None  # decode ran in CUDA graphs (M-RoPE positions + delta)


def test_engine_summary_says_the_model_takes_images(tiny):
    llm = LLM(str(tiny[0]), dtype="float32", device="cpu")
    assert llm.engine.summary["vision"] == {
        "image_processor": "Qwen2VLImageProcessor",
        "image_token_id": IMAGE_TOKEN_ID,
        "max_images": 8,
    }


def test_vision_tower_with_checkpoint_sized_windows_matches_transformers():
    """Qwen2.5-VL checkpoints' 112-pixel windows (4 x 4 merged blocks), cut at the image's edges."""
    from fw_llama.qwen2_5_vision import Qwen2_5VisionTransformer
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

    vision = dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48, window_size=112)
    vision.update(fullatt_block_indexes=[1], patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(0)
    reference = hf.Qwen2_5_VisionTransformerPretrainedModel(hf.Qwen2_5_VLVisionConfig(**vision)).eval()
    randomise_identity_params(reference)
    tower = Qwen2_5VisionTransformer(vision)
    tower.load_state_dict(reference.state_dict())
    processed = Qwen2VLImageProcessor({}).preprocess(random_image(300, 200, 3))  # 7 x 11 blocks: edge windows
    assert processed.grid == [1, 14, 22]
    pixels = torch.from_numpy(processed.pixel_values)
    with torch.no_grad():
        expected = reference(pixels, grid_thw=torch.tensor([processed.grid])).pooler_output
        torch.testing.assert_close(tower(pixels, processed.grid), expected, rtol=1e-4, atol=1e-4)
