"""Qwen3-VL, dense and MoE, through the whole engine matches transformers (fp32, tiny random models,
images of three sizes): logits at every computed position and greedy ids, with a chunked prefill
that splits the images' tokens (so the DeepStack features of an image arrive over several steps).

transformers gets the pixels fw's processor made (Qwen2-VL's processor with 16-pixel patches, which
``test_qwen2_5_vl`` pins against transformers' own). The MoE checkpoint is rewritten with its
experts in the released checkpoints' ``[E, in, out]`` layout, which transformers also reads.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fw_llama.qwen2_5_vl import frequency_sections
from fw_llama.qwen2_vl_processor import Qwen2VLImageProcessor, processor_settings

from framework import LLM, SamplingParams
from framework.testing import capture_logits, data_url, random_image, write_tiny_qwen3_vl
from framework.testing.vision import IMAGE_TOKEN_ID

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
#: 6, 12 and 4 image tokens (3x2, 3x4 and 2x2 merged blocks of 32 pixels)
IMAGES = [(96, 64, 1), (100, 130, 2), (40, 40, 3)]


def released_expert_layout(path) -> None:
    """Rewrite the checkpoint's stacked experts as the released Qwen3-VL-MoE files hold them."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["dense", "moe"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-qwen3_vl-{request.param}")
    reference = write_tiny_qwen3_vl(path, moe=request.param == "moe")
    if request.param == "moe":
        released_expert_layout(path)
    processor = Qwen2VLImageProcessor(processor_settings(json.loads((path / "preprocessor_config.json").read_text())))
    return path, reference, processor


def conversation(*images, text="t5 t6"):
    parts = [{"type": "text", "text": text}]
    for index, image in enumerate(images):
        parts += [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": f"t{20 + index}"},
        ]
    return [{"role": "user", "content": parts}]


def reference_inputs(processor, prompt_ids, images) -> dict:
    processed = [processor.preprocess(image) for image in images]
    ids = torch.tensor([prompt_ids])
    return dict(
        input_ids=ids,
        pixel_values=torch.from_numpy(np.concatenate([p.pixel_values for p in processed])),
        image_grid_thw=torch.tensor([p.grid for p in processed]),
        mm_token_type_ids=(ids == IMAGE_TOKEN_ID).int(),
    )


def test_interleaved_sections_alternate_until_height_and_width_run_out():
    assert frequency_sections([2, 3, 3], interleaved=True) == [0, 1, 2, 0, 1, 2, 0, 1]
    assert frequency_sections([24, 20, 20], interleaved=True)[57:64] == [0, 1, 2, 0, 0, 0, 0]
    assert frequency_sections([2, 3, 3], interleaved=False) == [0, 0, 1, 1, 1, 2, 2, 2]


def test_logits_and_greedy_ids_match_transformers_with_three_images_split_by_chunked_prefill(tiny):
    path, reference, processor = tiny
    llm = LLM(str(path), dtype="float32", device="cpu", prefill_chunk_size=8)
    logits = capture_logits(llm)
    images = [random_image(*size) for size in IMAGES]
    result = llm.chat(conversation(*images), GREEDY)[0]
    prompt = result.prompt_token_ids
    first = prompt.index(IMAGE_TOKEN_ID)
    assert first // 8 != (first + 5) // 8  # the first image's 6 tokens cross a chunk boundary
    assert prompt.count(IMAGE_TOKEN_ID) == 6 + 12 + 4
    inputs = reference_inputs(processor, prompt, images)
    with torch.no_grad():
        expected = reference.generate(
            **inputs, attention_mask=torch.ones_like(inputs["input_ids"]), max_new_tokens=10, do_sample=False
        )[0, len(prompt) :].tolist()
    assert result.outputs[0].token_ids == expected
    # every position the engine computed: the prompt's (M-RoPE, DeepStack) and decode's (index + delta)
    sequence = prompt + expected[:-1]
    with torch.no_grad():
        want = reference(**reference_inputs(processor, sequence, images)).logits[0]
    got = torch.stack([logits[("0-0", position)] for position in range(len(sequence))])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert llm.engine.core.runner.multimodal.num_encoder_runs == 3  # each image once, though split over steps
    assert llm.engine.summary["vision"]["image_processor"] == "Qwen2VLImageProcessor"


@pytest.mark.gpu
def test_greedy_ids_match_transformers_on_cuda_with_graphs_and_async_scheduling(tiny):
    path, reference, processor = tiny
    llm = LLM(str(path), dtype="float32", device="cuda", prefill_chunk_size=8, async_scheduling=True)
    images = [random_image(*size) for size in IMAGES]
    conversations = [conversation(*images), conversation(images[1], text="t9")]
    results = llm.chat(conversations, GREEDY)
    for result, used in zip(results, [images, images[1:2]], strict=True):
        inputs = reference_inputs(processor, result.prompt_token_ids, used)
        with torch.no_grad():
            expected = reference.generate(
                **inputs, attention_mask=torch.ones_like(inputs["input_ids"]), max_new_tokens=10, do_sample=False
            )
        assert result.outputs[0].token_ids == expected[0, len(result.prompt_token_ids) :].tolist()
    assert llm.engine.core.runner.graph_runner is not None  # decode ran in CUDA graphs (M-RoPE positions + delta)
