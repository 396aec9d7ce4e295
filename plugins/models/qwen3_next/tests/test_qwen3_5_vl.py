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

import json

import numpy as np
import pytest
import torch
from fw_llama.qwen2_vl_processor import Qwen2VLImageProcessor, processor_settings

from framework import LLM, SamplingParams
from framework.testing import capture_logits, data_url, random_image, write_tiny_qwen3_5_vl
from framework.testing.vision import IMAGE_TOKEN_ID

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
#: 6 and 12 image tokens (3x2 and 3x4 merged blocks of 32 pixels)
IMAGES = [(96, 64, 1), (100, 130, 2)]

_MODELS: dict[str, tuple] = {}


def _written(name: str, tmp_path_factory) -> tuple:
    """``(path, transformers reference, processor)`` of the tiny model ``name``, written once."""
    if name not in _MODELS:
        path = tmp_path_factory.mktemp(f"tiny-qwen3_5_vl-{name}")
        reference = write_tiny_qwen3_5_vl(path, moe=name == "moe")
        settings = processor_settings(json.loads((path / "preprocessor_config.json").read_text()))
        _MODELS[name] = (path, reference, Qwen2VLImageProcessor(settings))
    return _MODELS[name]


@pytest.fixture(scope="module", params=["dense", "moe"])
def tiny(request, tmp_path_factory):
    return _written(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The dense model, for the engine-level checks (preemption, the prefix-cache rule)."""
    return _written("dense", tmp_path_factory)


def conversation(*images, text="t5 t6"):
    parts = [{"type": "text", "text": text}]
    for index, image in enumerate(images):
        parts += [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": f"t{20 + index}"},
        ]
    return [{"role": "user", "content": parts}]


def reference_inputs(processor, ids: list[int], images) -> dict:
    """transformers' inputs for ``ids`` (image tokens expanded) and ``images`` (none: text only)."""
    tensor = torch.tensor([ids])
    if not images:
        return dict(input_ids=tensor)
    processed = [processor.preprocess(image) for image in images]
    return dict(
        input_ids=tensor,
        pixel_values=torch.from_numpy(np.concatenate([p.pixel_values for p in processed])),
        image_grid_thw=torch.tensor([p.grid for p in processed]),
        mm_token_type_ids=(tensor == IMAGE_TOKEN_ID).int(),
    )


def check_against_transformers(reference, processor, logits, request_id: str, result, images, steps=STEPS) -> None:
    """The request's greedy ids are transformers' (EOS not stopping it, as ``ignore_eos``), and the
    logits fw computed at every position (prompt, then decode) are within 1e-4 of transformers'."""
    prompt = result.prompt_token_ids
    inputs = reference_inputs(processor, prompt, images)
    with torch.no_grad():
        expected = reference.generate(
            **inputs,
            attention_mask=torch.ones_like(inputs["input_ids"]),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
        assert result.outputs[0].token_ids == expected
        sequence = prompt + expected[:-1]
        want = reference(**reference_inputs(processor, sequence, images)).logits[0]
    got = torch.stack([logits[(request_id, position)] for position in range(len(sequence))])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_logits_and_greedy_ids_match_transformers_with_images_split_by_chunked_prefill(tiny):
    path, reference, processor = tiny
    llm = LLM(str(path), dtype="float32", device="cpu", prefill_chunk_size=8, max_num_batched_tokens=16)
    logits = capture_logits(llm)
    images = [random_image(*size) for size in IMAGES]
    chats = [conversation(*images), conversation(images[1], text="t9")]
    results = llm.chat(chats, GREEDY)
    first = results[0].prompt_token_ids
    start = first.index(IMAGE_TOKEN_ID)
    assert start // 8 != (start + 5) // 8  # the first image's 6 tokens cross a chunk boundary
    assert first.count(IMAGE_TOKEN_ID) == 6 + 12
    for index, (result, used) in enumerate(zip(results, [images, images[1:]], strict=True)):
        check_against_transformers(reference, processor, logits, f"{index}-0", result, used)
    assert llm.engine.core.runner.multimodal.num_encoder_runs == 3  # each image once per request, across chunks
    assert llm.engine.summary["state_slots"] > 0
    assert llm.engine.summary["vision"]["image_processor"] == "Qwen2VLImageProcessor"


def test_async_scheduling_mixes_a_text_decode_and_an_image_prefill_with_the_same_ids(dense):
    path, reference, processor = dense
    llm = LLM(str(path), dtype="float32", device="cpu", prefill_chunk_size=8, async_scheduling=True)
    assert llm.engine.core.async_scheduling
    logits = capture_logits(llm)
    image = random_image(*IMAGES[1])
    # the short text-only prompt decodes (plain positions, its input on the device) while the image
    # prompt's chunks prefill ([3, T] positions), each on its own state slot
    results = llm.chat([[{"role": "user", "content": "t5"}], conversation(image)], GREEDY)
    for index, (result, used) in enumerate(zip(results, [[], [image]], strict=True)):
        check_against_transformers(reference, processor, logits, f"{index}-0", result, used)


def test_preempted_requests_with_images_rebuild_their_state_without_encoding_again(dense):
    path, reference, processor = dense
    # 3 requests of 14-18 prompt tokens and 16 generated ones in 5 blocks of 16: they preempt each other
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=5, block_size=16, max_num_seqs=3)
    logits = capture_logits(llm)  # a recomputed position keeps its last logits
    images = [random_image(64 + 32 * i, 64, 10 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    results = llm.chat([conversation(image) for image in images], params)
    core = llm.engine.core
    assert core.stats().num_preemptions > 0
    for index, (image, result) in enumerate(zip(images, results, strict=True)):
        check_against_transformers(reference, processor, logits, f"{index}-0", result, [image], steps=16)
    assert core.runner.multimodal.num_encoder_runs == 3
    assert core.scheduler.state_slots.num_free_slots == core.scheduler.state_slots.num_slots


def test_prefix_caching_is_off_so_a_repeated_image_prompt_is_recomputed_with_the_same_ids(dense, caplog):
    path, reference, processor = dense
    with caplog.at_level("INFO", logger="fw.engine"):
        llm = LLM(str(path), dtype="float32", device="cpu", block_size=4)
    assert "prefix caching is off" in caplog.text
    logits = capture_logits(llm)
    image = random_image(128, 128, 5)
    first = llm.chat(conversation(image), GREEDY)[0]
    second = llm.chat(conversation(image), GREEDY)[0]
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    assert second.prompt_token_ids == first.prompt_token_ids
    check_against_transformers(reference, processor, logits, "1-0", second, [image])
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
    path, reference, processor = tiny
    llm = LLM(str(path), dtype="float32", device="cuda", prefill_chunk_size=8, async_scheduling=True)
    assert "decode graphs" in llm.engine.summary["cuda_graphs"]
    logits = capture_logits(llm)
    images = [random_image(*size) for size in IMAGES]
    results = llm.chat([conversation(*images), conversation(images[1], text="t9")], GREEDY)
    logits = {key: value.cpu() for key, value in logits.items()}
    for index, (result, used) in enumerate(zip(results, [images, images[1:]], strict=True)):
        check_against_transformers(reference, processor, logits, f"{index}-0", result, used)
