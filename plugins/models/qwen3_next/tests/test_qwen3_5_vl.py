"""Qwen3.5 and Qwen3.5-MoE with images through the whole engine match transformers (fp32, tiny random
hybrid models: DeltaNet, gated attention, DeltaNet; Qwen3-VL's tower without DeepStack).

Logits at every computed position and greedy ids of a batch of two chats (two images of different
sizes, and one image) with prefill chunks of 8 that split the first image's tokens, so the
DeltaNet state slots carry across image rows mid-image and the attention layer's interleaved
M-RoPE positions arrive chunk by chunk; a text-only decode beside an image prefill under async
scheduling; preemption, after which a request rebuilds its state from
token 0 with the image embeddings it already has; and the prefix-cache rule of hybrid models
(off: a repeated image prompt is recomputed, with the same ids).

transformers gets the pixels fw's processor made (Qwen2-VL's processor with 16-pixel patches, which
``test_qwen2_5_vl`` pins against transformers' own).
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from fw_llama.qwen2_vl_processor import Qwen2VLImageProcessor, processor_settings

from framework import LLM, SamplingParams
from framework.testing import (
    VisionReference,
    capture_logits,
    check_image_request,
    check_preempted_image_requests,
    image_chat,
    qwen_vl_inputs,
    random_image,
    write_tiny_qwen3_5_vl,
)
from framework.testing.vision import IMAGE_TOKEN_ID

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
#: 6 and 12 image tokens (3x2 and 3x4 merged blocks of 32 pixels)
IMAGES = [(96, 64, 1), (100, 130, 2)]

_MODELS: dict[str, tuple] = {}


def _written(name: str, tmp_path_factory) -> tuple:
    """``(path, transformers reference)`` of the tiny model ``name``, written once."""
    if name not in _MODELS:
        path = tmp_path_factory.mktemp(f"tiny-qwen3_5_vl-{name}")
        reference = write_tiny_qwen3_5_vl(path, moe=name == "moe")
        settings = processor_settings(json.loads((path / "preprocessor_config.json").read_text()))
        processor = Qwen2VLImageProcessor(settings)
        _MODELS[name] = (path, VisionReference(reference, functools.partial(qwen_vl_inputs, processor)))
    return _MODELS[name]


@pytest.fixture(scope="module", params=["dense", "moe"])
def tiny(request, tmp_path_factory):
    return _written(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The dense model, for the engine-level checks (preemption, the prefix-cache rule)."""
    return _written("dense", tmp_path_factory)


def test_logits_and_greedy_ids_match_transformers_with_images_split_by_chunked_prefill(tiny):
    path, reference = tiny
    llm = LLM(str(path), dtype="float32", device="cpu", prefill_chunk_size=8, max_num_batched_tokens=16)
    logits = capture_logits(llm)
    images = [random_image(*size) for size in IMAGES]
    chats = [image_chat(*images), image_chat(images[1], text="t9")]
    results = llm.chat(chats, GREEDY)
    first = results[0].prompt_token_ids
    start = first.index(IMAGE_TOKEN_ID)
    assert start // 8 != (start + 5) // 8  # the first image's 6 tokens cross a chunk boundary
    assert first.count(IMAGE_TOKEN_ID) == 6 + 12
    for index, (result, used) in enumerate(zip(results, [images, images[1:]], strict=True)):
        check_image_request(logits, f"{index}-0", result, reference, used, STEPS)
    assert llm.engine.core.runner.multimodal.num_encoder_runs == 3  # each image once per request, across chunks
    assert llm.engine.summary["state_slots"] > 0
    assert llm.engine.summary["vision"]["image_processor"] == "Qwen2VLImageProcessor"


def test_async_scheduling_mixes_a_text_decode_and_an_image_prefill_with_the_same_ids(dense):
    path, reference = dense
    llm = LLM(str(path), dtype="float32", device="cpu", prefill_chunk_size=8, async_scheduling=True)
    assert llm.engine.core.async_scheduling
    logits = capture_logits(llm)
    image = random_image(*IMAGES[1])
    # the short text-only prompt decodes (plain positions, its input on the device) while the image
    # prompt's chunks prefill ([3, T] positions), each on its own state slot
    results = llm.chat([[{"role": "user", "content": "t5"}], image_chat(image)], GREEDY)
    for index, (result, used) in enumerate(zip(results, [[], [image]], strict=True)):
        check_image_request(logits, f"{index}-0", result, reference, used, STEPS)


def test_preempted_requests_with_images_rebuild_their_state_without_encoding_again(dense):
    path, reference = dense
    # 3 requests of 14-18 prompt tokens and 16 generated ones in 5 blocks of 16: they preempt each other
    # (from token 0, the prompt and decode positions alike; prefix caching is off for hybrids anyway)
    images = [random_image(64 + 32 * i, 64, 10 + i) for i in range(3)]
    llm = check_preempted_image_requests(path, reference, images, num_blocks=5, max_tokens=16, decoded=True)
    slots = llm.engine.core.scheduler.state_slots
    assert slots.num_free_slots == slots.num_slots


def test_prefix_caching_is_off_so_a_repeated_image_prompt_is_recomputed_with_the_same_ids(dense, caplog):
    path, reference = dense
    with caplog.at_level("INFO", logger="fw.engine"):
        llm = LLM(str(path), dtype="float32", device="cpu", block_size=4)
    assert "prefix caching is off" in caplog.text
    logits = capture_logits(llm)
    image = random_image(128, 128, 5)
    first = llm.chat(image_chat(image), GREEDY)[0]
    second = llm.chat(image_chat(image), GREEDY)[0]
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    assert second.prompt_token_ids == first.prompt_token_ids
    check_image_request(logits, "1-0", second, reference, [image], STEPS)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.core.runner.multimodal.num_encoder_runs == 2  # no cache: the second request encodes again


def test_a_tower_whose_output_is_not_the_text_width_is_refused_naming_both(dense):
    from fw_qwen3_next.qwen3_5_vl import Qwen3_5ForConditionalGeneration

    from framework.config import ModelConfig

    hf = json.loads((dense[0] / "config.json").read_text())
    hf["vision_config"]["out_hidden_size"] = 48
    config = ModelConfig.from_hf_config(hf, dtype=torch.float32)
    with pytest.raises(ValueError, match="out_hidden_size 48 must equal the text model's hidden_size 64"):
        Qwen3_5ForConditionalGeneration(config)


def test_a_config_without_an_image_token_id_takes_transformers_default(dense):
    """transformers' Qwen3_5Config defaults ``image_token_id`` to 248056 (``<|image_pad|>``)."""
    from fw_qwen3_next.qwen3_5_vl import Qwen3_5ForConditionalGeneration

    from framework.config import ModelConfig

    hf = json.loads((dense[0] / "config.json").read_text())
    del hf["image_token_id"]
    spec = Qwen3_5ForConditionalGeneration.vision_spec(ModelConfig.from_hf_config(hf, dtype=torch.float32), {})
    assert spec.image_token_id == 248056
    assert spec.processor_config["patch_size"] == 16 and spec.processor_config["merge_size"] == 2  # the tower's


@pytest.mark.gpu
def test_greedy_ids_match_transformers_on_cuda_with_graphs_and_async_scheduling(tiny):
    path, reference = tiny
    llm = LLM(str(path), dtype="float32", device="cuda", prefill_chunk_size=8, async_scheduling=True)
    assert "decode graphs" in llm.engine.summary["cuda_graphs"]
    logits = capture_logits(llm)
    images = [random_image(*size) for size in IMAGES]
    results = llm.chat([image_chat(*images), image_chat(images[1], text="t9")], GREEDY)
    logits = {key: value.cpu() for key, value in logits.items()}
    for index, (result, used) in enumerate(zip(results, [images, images[1:]], strict=True)):
        check_image_request(logits, f"{index}-0", result, reference, used, STEPS)
