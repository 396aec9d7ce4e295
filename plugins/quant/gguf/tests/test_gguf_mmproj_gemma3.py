"""A Gemma 3 text GGUF with its llama.cpp vision projector (``mmproj*.gguf``, type ``gemma3``) beside it
takes images: both files are written from one tiny random transformers Gemma 3 the way llama.cpp's
converter writes them (:mod:`gemma3_gguf`), and fw on them gives transformers' logits at every
position and its greedy ids for a chat with two images in a chunked prefill, with an F32 and an
F16 projector. Without the projector the model is Gemma 3's text model.

The tiny model has six layers, five sliding and one global, because llama.cpp's files state no
pattern (one global layer in six). fw's GGUF tokenizer is not the checkpoint's word tokenizer, so
transformers gets fw's prompt ids; its pixels are fw's processor's (pinned against transformers'
own in ``test_gemma3_vision``). The reference holds the f16-rounded weights the file does (the
input projection is f16 in every file; with F16 the tower's matrices too).
"""

from __future__ import annotations

import functools
import shutil
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from framework import LLM, SamplingParams
from framework.errors import ConfigError, ModelLoadError
from framework.multimodal.inputs import load_processor
from framework.testing import (
    VisionReference,
    capture_logits,
    check_image_request,
    gemma3_inputs,
    image_chat,
    random_image,
    write_tiny_gemma3,
)
from framework.testing.vision import IMAGE_TOKEN_ID
from framework.testing.vision_gemma3 import GEMMA3_SPECIALS

sys.path.insert(0, str(Path(__file__).parent))
from gemma3_gguf import rounded_reference, write_mmproj, write_text_gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BOI, EOI = GEMMA3_SPECIALS["<start_of_image>"], GEMMA3_SPECIALS["<end_of_image>"]
SPAN = [BOI] + [IMAGE_TOKEN_ID] * 16 + [EOI]
LAYERS = ["sliding_attention"] * 5 + ["full_attention"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``(hf dir, gguf dir, transformers model)``: the text GGUF and an F32 and F16 projector, apart."""
    root = tmp_path_factory.mktemp("gemma3")
    reference = write_tiny_gemma3(root / "hf", layer_types=LAYERS)
    write_text_gguf(root / "hf", root / "model-F32.gguf")
    for outtype in (Q.F32, Q.F16):
        (root / outtype.name).mkdir()
        write_mmproj(root / "hf", root / outtype.name / f"mmproj-{outtype.name}.gguf", outtype)
    return root / "hf", root, reference


def served(root: Path, outtype: str, tmp_path: Path) -> Path:
    """The text GGUF with the ``outtype`` projector beside it (none for ""), in a folder of their own."""
    shutil.copy(root / "model-F32.gguf", tmp_path / "model-F32.gguf")
    if outtype:
        shutil.copy(root / outtype / f"mmproj-{outtype}.gguf", tmp_path / f"mmproj-{outtype}.gguf")
    return tmp_path / "model-F32.gguf"


def vision_reference(model, llm) -> VisionReference:
    """``model`` fed the pixels of ``llm``'s processor (the one the GGUF's projector configures)."""
    return VisionReference(model, functools.partial(gemma3_inputs, load_processor(llm.engine.vision)))


@pytest.mark.parametrize("outtype", ["F32", "F16"])
def test_logits_and_greedy_ids_match_transformers_with_the_projector_beside_the_model(checkpoint, outtype, tmp_path):
    hf, root, reference = checkpoint
    reference = rounded_reference(reference, outtype)
    llm = LLM(str(served(root, outtype, tmp_path)), dtype="float32", device="cpu", prefill_chunk_size=8)
    assert llm.engine.model_config.architecture == "Gemma3ForConditionalGeneration"
    logits = capture_logits(llm)
    images = [random_image(84, 56, 1), random_image(40, 120, 2)]
    result = llm.chat(image_chat(*images), GREEDY)[0]
    prompt = result.prompt_token_ids
    first = prompt.index(BOI)
    assert prompt[first : first + 18] == SPAN and prompt.count(IMAGE_TOKEN_ID) == 32
    check_image_request(logits, "0-0", result, vision_reference(reference, llm), images, GREEDY.max_tokens)


def test_the_tower_holds_the_files_weights_and_the_files_settings_and_token_ids(checkpoint, tmp_path):
    hf, root, reference = checkpoint
    llm = LLM(str(served(root, "F32", tmp_path)), dtype="float32", device="cpu", num_blocks=8)
    model = llm.engine.core.runner.model
    expected = rounded_reference(reference, "F32").model
    for ours, theirs in (
        (model.vision_tower, expected.vision_tower),
        (model.multi_modal_projector, expected.multi_modal_projector),
    ):
        state, want = ours.state_dict(), theirs.state_dict()
        assert state.keys() == want.keys()
        for name, value in want.items():  # the soft-embedding norm's w: (1 + w) - 1 in f32, within an ulp of 1
            atol = 2**-23 if name == "mm_soft_emb_norm.weight" else 0.0
            torch.testing.assert_close(state[name], value, rtol=0, atol=atol, msg=name)
    vision = llm.engine.vision
    assert (vision.image_token_id, vision.placeholder_token_id, vision.layout_token_ids) == (
        IMAGE_TOKEN_ID,
        BOI,
        [BOI, EOI],
    )
    settings = vision.processor_config
    assert (settings["image_size"], settings["patch_size"], settings["mm_tokens_per_image"]) == (56, 7, 16)
    assert settings["image_mean"] == settings["image_std"] == pytest.approx([0.5] * 3)


def test_without_the_projector_the_text_model_answers_and_an_image_is_refused(checkpoint, tmp_path):
    hf, root, reference = checkpoint
    llm = LLM(str(served(root, "", tmp_path)), dtype="float32", device="cpu", num_blocks=8)
    assert llm.engine.vision is None and llm.engine.model_config.architecture == "Gemma3ForCausalLM"
    prompt = [0, 290, 5, 6, 7, 291, 290]
    got = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    with torch.no_grad():
        expected = reference.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    assert got == expected[0, len(prompt) :].tolist()
    assert "mmproj*.gguf" in llm.engine.summary["text_only_reason"]
    with pytest.raises(ConfigError, match=r"messages\[0\]\.content\[1\]: this model .* does not take images: .*mmproj"):
        llm.chat(image_chat(random_image(56, 56, 1)), GREEDY)


def test_a_qwen_projector_for_the_gemma3_model_is_refused_naming_the_one_it_takes(checkpoint, tmp_path):
    import gguf

    hf, root, reference = checkpoint
    path = tmp_path / "mmproj-qwen.gguf"
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type("qwen2.5vl_merger")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    (tmp_path / "model").mkdir()
    model = served(root, "", tmp_path / "model")
    with pytest.raises(
        ModelLoadError, match="a qwen2.5vl_merger projector goes with a qwen2vl text GGUF; this model is gemma3"
    ):
        LLM(str(model), mmproj=str(path), dtype="float32", device="cpu")


def test_a_vocabulary_without_gemmas_image_tokens_is_refused_naming_them(checkpoint):
    from fw_gguf.config import hf_config_from_gguf
    from fw_gguf.mmproj import Projector, ProjectorError, vision_hf_config
    from fw_gguf.reader import open_gguf

    hf, root, reference = checkpoint
    metadata = dict(open_gguf(root / "model-F32.gguf").metadata)
    projector = Projector(root / "F32" / "mmproj-F32.gguf")
    config = vision_hf_config(hf_config_from_gguf(metadata), metadata, projector)
    assert (config["image_token_index"], config["boi_token_index"], config["eoi_token_index"]) == (294, 292, 293)
    tokens = list(metadata["tokenizer.ggml.tokens"])
    tokens[292], tokens[294] = "<unused292>", "<unused294>"
    with pytest.raises(ProjectorError, match="vocabulary has no <image_soft_token>, <start_of_image> token"):
        vision_hf_config(hf_config_from_gguf(metadata), {**metadata, "tokenizer.ggml.tokens": tokens}, projector)


@pytest.mark.gpu
def test_greedy_ids_match_transformers_on_cuda_with_an_f16_projector(checkpoint, tmp_path):
    hf, root, reference = checkpoint
    reference = rounded_reference(reference, "F16")
    llm = LLM(str(served(root, "F16", tmp_path)), dtype="float32", device="cuda", prefill_chunk_size=8)
    images = [random_image(84, 56, 1), random_image(40, 120, 2)]
    results = llm.chat([image_chat(*images), image_chat(images[1])], GREEDY)
    vision = vision_reference(reference, llm)
    for result, shown in zip(results, (images, images[1:]), strict=True):
        assert result.outputs[0].token_ids == vision.greedy(result.prompt_token_ids, shown, GREEDY.max_tokens)
