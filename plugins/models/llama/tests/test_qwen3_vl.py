"""Qwen3-VL, dense and MoE, through the whole engine matches transformers (fp32, tiny random models,
images of three sizes): logits at every computed position and greedy ids, with a chunked prefill
that splits the images' tokens (so the DeepStack features of an image arrive over several steps).

transformers gets the pixels fw's processor made (Qwen2-VL's processor with 16-pixel patches, which
``test_qwen2_5_vl`` pins against transformers' own). The MoE checkpoint is rewritten with its
experts in the released checkpoints' ``[E, in, out]`` layout, which transformers also reads.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from fw_llama.qwen2_5_vl import frequency_sections
from fw_llama.qwen2_vl_processor import Qwen2VLImageProcessor, processor_settings

from framework import LLM, SamplingParams
from framework.testing import (
    VisionReference,
    capture_logits,
    check_image_request,
    check_prefix_hit_inside_an_image,
    image_chat,
    qwen_vl_inputs,
    random_image,
    write_tiny_qwen3_vl,
)
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
    return path, VisionReference(reference, functools.partial(qwen_vl_inputs, processor))


def test_interleaved_sections_alternate_until_height_and_width_run_out():
    assert frequency_sections([2, 3, 3], interleaved=True) == [0, 1, 2, 0, 1, 2, 0, 1]
    assert frequency_sections([24, 20, 20], interleaved=True)[57:64] == [0, 1, 2, 0, 0, 0, 0]
    assert frequency_sections([2, 3, 3], interleaved=False) == [0, 0, 1, 1, 1, 2, 2, 2]


def test_logits_and_greedy_ids_match_transformers_with_three_images_split_by_chunked_prefill(tiny):
    path, reference = tiny
    llm = LLM(str(path), dtype="float32", device="cpu", prefill_chunk_size=8)
    logits = capture_logits(llm)
    images = [random_image(*size) for size in IMAGES]
    result = llm.chat(image_chat(*images), GREEDY)[0]
    prompt = result.prompt_token_ids
    first = prompt.index(IMAGE_TOKEN_ID)
    assert first // 8 != (first + 5) // 8  # the first image's 6 tokens cross a chunk boundary
    assert prompt.count(IMAGE_TOKEN_ID) == 6 + 12 + 4
    # every position the engine computed: the prompt's (M-RoPE, DeepStack) and decode's (index + delta)
    check_image_request(logits, "0-0", result, reference, images, GREEDY.max_tokens)
    assert llm.engine.core.runner.multimodal.num_encoder_runs == 3  # each image once, though split over steps
    assert llm.engine.summary["vision"]["image_processor"] == "Qwen2VLImageProcessor"


def test_a_prefix_cache_hit_that_ends_inside_an_image_continues_with_its_deepstack_rows(tiny):
    path, reference = tiny
    # two keyed blocks of 4: the hit covers tokens 0..7, and the image's 16 tokens start at 3
    check_prefix_hit_inside_an_image(path, reference, random_image(128, 128, 5), GREEDY, (IMAGE_TOKEN_ID, 16), 8)


def test_vision_tower_with_a_checkpoint_sized_position_grid_matches_transformers():
    """Qwen3-VL checkpoints' 48x48 learned positions, resampled to a 14x22 patch grid (bilinear,
    corners aligned), and DeepStack features from two of three blocks."""
    from fw_llama.qwen3_vision import Qwen3VisionTransformer
    from transformers.models.qwen3_vl import modeling_qwen3_vl as hf

    from framework.testing import randomise_identity_params

    vision = dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48, patch_size=16)
    vision.update(num_position_embeddings=2304, deepstack_visual_indexes=[0, 2], spatial_merge_size=2)
    torch.manual_seed(0)
    reference = hf.Qwen3VLVisionModel(hf.Qwen3VLVisionConfig(**vision)).eval()
    randomise_identity_params(reference)
    tower = Qwen3VisionTransformer(vision)
    tower.load_state_dict(reference.state_dict())
    processed = Qwen2VLImageProcessor({"patch_size": 16, "max_pixels": 10**6}).preprocess(random_image(352, 224, 3))
    assert processed.grid == [1, 14, 22]
    pixels, grid = torch.from_numpy(processed.pixel_values), torch.tensor([processed.grid])
    with torch.no_grad():
        expected = reference(pixels, grid_thw=grid)
        got = tower(pixels, processed.grid)
    torch.testing.assert_close(
        got, torch.cat([expected.pooler_output, *expected.deepstack_features], -1), rtol=1e-4, atol=1e-4
    )


@pytest.mark.gpu
def test_greedy_ids_match_transformers_on_cuda_with_graphs_and_async_scheduling(tiny):
    path, reference = tiny
    llm = LLM(str(path), dtype="float32", device="cuda", prefill_chunk_size=8, async_scheduling=True)
    images = [random_image(*size) for size in IMAGES]
    results = llm.chat([image_chat(*images), image_chat(images[1], text="t9")], GREEDY)
    for result, used in zip(results, [images, images[1:2]], strict=True):
        assert result.outputs[0].token_ids == reference.greedy(result.prompt_token_ids, used, GREEDY.max_tokens)
    assert llm.engine.core.runner.graph_runner is not None  # decode ran in CUDA graphs (M-RoPE positions + delta)
