"""A Qwen2.5-VL / Qwen3-VL text GGUF with its llama.cpp vision projector (``mmproj*.gguf``) beside it
takes images: both files are written from one tiny random transformers model the way llama.cpp's
converter writes them (:mod:`qwen_vl_gguf`), and fw on them gives transformers' logits at every
position and its greedy ids for a chat with images, with an F32 and an F16 projector. Without a
projector the model is its text model and an image is refused, saying where fw looked.

fw's GGUF tokenizer is not the checkpoint's word tokenizer, so transformers gets fw's prompt ids;
its pixels are fw's processor's (pinned against transformers' own in ``test_qwen2_5_vl``). With an
F16 projector the reference tower holds the same f16-rounded weights the file does.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from framework import LLM, SamplingParams
from framework.errors import ConfigError, ModelLoadError
from framework.testing import (
    capture_logits,
    data_url,
    qwen_vl_inputs,
    random_image,
    write_tiny_qwen2_5_vl,
    write_tiny_qwen3_vl,
)
from framework.testing.vision import IMAGE_TOKEN_ID

sys.path.insert(0, str(Path(__file__).parent))
from qwen_vl_gguf import write_mmproj, write_text_gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
#: Qwen2.5-VL: 12 x 8 patches (6 x 4 merged blocks: a 4 x 4 window and one cut at the edge) and 4 x 4;
#: Qwen3-VL: raised to its 256 x 256 minimum, 8 x 8 merged blocks each
IMAGES = [(168, 112, 1), (56, 56, 2)]


def conversation(*images):
    parts = [{"type": "text", "text": "t5 t6"}]
    for index, image in enumerate(images):
        parts += [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": f" t{20 + index}"},
        ]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def checkpoint(request, tmp_path_factory):
    """``(hf dir, gguf dir, transformers model)``: the text GGUF and an F32 and F16 projector, apart."""
    root = tmp_path_factory.mktemp(request.param)
    hf = root / "hf"
    if request.param == "qwen2_5_vl":
        reference = write_tiny_qwen2_5_vl(hf, window_size=112)  # llama.cpp's windows: files do not state them
    else:
        reference = write_tiny_qwen3_vl(hf, moe=request.param == "qwen3_vl_moe")
    sharpen_tower_attention(reference, hf)
    write_text_gguf(hf, root / "model-F32.gguf")
    for outtype in (Q.F32, Q.F16):
        (root / outtype.name).mkdir()
        write_mmproj(hf, root / outtype.name / f"mmproj-{outtype.name}.gguf", outtype)
    return hf, root, reference


def sharpen_tower_attention(reference, hf: Path) -> None:
    """Scale the tower's query and key weights up (and save the checkpoint again), so its attention
    is far from uniform and a query/key mix-up changes the image embeddings."""
    with torch.no_grad():
        for block in reference.model.visual.blocks:
            dim = block.attn.qkv.weight.shape[1]
            block.attn.qkv.weight[: 2 * dim].mul_(12)
    reference.save_pretrained(hf, safe_serialization=True)


def served(root: Path, outtype: str, tmp_path: Path) -> Path:
    """The text GGUF with the ``outtype`` projector beside it, in a folder of their own."""
    shutil.copy(root / "model-F32.gguf", tmp_path / "model-F32.gguf")
    if outtype:
        shutil.copy(root / outtype / f"mmproj-{outtype}.gguf", tmp_path / f"mmproj-{outtype}.gguf")
    return tmp_path / "model-F32.gguf"


def rounded_tower(reference, outtype: str):
    """``reference`` with its tower's weights as the ``outtype`` projector holds them (F16: the
    matrices and convolutions rounded to f16, as the converter writes them)."""
    if outtype == "F32":
        return reference
    import copy

    rounded = copy.deepcopy(reference)
    with torch.no_grad():
        for param in rounded.model.visual.parameters():
            if param.dim() >= 2:
                param.copy_(param.half().float())
    return rounded


def reference_inputs(llm, prompt_ids, images) -> dict:
    from framework.multimodal.inputs import load_processor

    return qwen_vl_inputs(load_processor(llm.engine.vision), prompt_ids, images)


@pytest.mark.parametrize("outtype", ["F32", "F16"])
def test_logits_and_greedy_ids_match_transformers_with_the_projector_beside_the_model(checkpoint, outtype, tmp_path):
    hf, root, reference = checkpoint
    reference = rounded_tower(reference, outtype)
    llm = LLM(str(served(root, outtype, tmp_path)), dtype="float32", device="cpu", prefill_chunk_size=16)
    assert llm.engine.model_config.architecture == reference.config.architectures[0]
    logits = capture_logits(llm)
    images = [random_image(*size) for size in IMAGES]
    result = llm.chat(conversation(*images), GREEDY)[0]
    prompt = result.prompt_token_ids
    inputs = reference_inputs(llm, prompt, images)
    assert prompt.count(IMAGE_TOKEN_ID) == sum(int(np.prod(g)) // 4 for g in inputs["image_grid_thw"].tolist())
    with torch.no_grad():
        expected = reference.generate(
            **inputs, attention_mask=torch.ones_like(inputs["input_ids"]), max_new_tokens=6, do_sample=False
        )[0, len(prompt) :].tolist()
        want = reference(**reference_inputs(llm, prompt + expected[:-1], images)).logits[0]
    assert result.outputs[0].token_ids == expected
    got = torch.stack([logits[("0-0", position)] for position in range(len(prompt) + len(expected) - 1)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_quantized_text_gguf_keeps_its_blocks_packed_beside_the_float_tower(checkpoint, tmp_path, check_kept_packed):
    """Q8_0 text matrices: the logits and greedy ids of transformers with those matrices dequantized."""
    import copy

    import gguf

    hf, root, reference = checkpoint
    write_text_gguf(hf, tmp_path / "model-Q8_0.gguf", Q.Q8_0)
    shutil.copy(root / "F32" / "mmproj-F32.gguf", tmp_path)
    llm = LLM(str(tmp_path / "model-Q8_0.gguf"), dtype="float32", device="cpu", num_blocks=16)
    model = llm.engine.core.runner.model
    assert check_kept_packed(model.model, Q.Q8_0)
    assert not any(name.startswith("visual.") for name in check_kept_packed(model, Q.Q8_0))
    dequantized = copy.deepcopy(reference)
    with torch.no_grad():
        for name, param in dequantized.named_parameters():
            if param.dim() == 2 and "visual" not in name:
                values = gguf.quants.quantize(param.numpy(), Q.Q8_0)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(values, Q.Q8_0)))
    logits = capture_logits(llm)
    images = [random_image(*IMAGES[0])]
    result = llm.chat(conversation(*images), GREEDY)[0]
    prompt = result.prompt_token_ids
    inputs = reference_inputs(llm, prompt, images)
    with torch.no_grad():
        expected = dequantized.generate(
            **inputs, attention_mask=torch.ones_like(inputs["input_ids"]), max_new_tokens=6, do_sample=False
        )[0, len(prompt) :].tolist()
        want = dequantized(**inputs).logits[0]
    assert result.outputs[0].token_ids == expected
    got = torch.stack([logits[("0-0", position)] for position in range(len(prompt))])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # unquantized weights differ by ~5e-3


def test_the_tower_loads_the_checkpoints_weights_and_the_files_processor_settings(checkpoint, tmp_path):
    hf, root, reference = checkpoint
    llm = LLM(str(served(root, "F32", tmp_path)), dtype="float32", device="cpu", num_blocks=8)
    tower = llm.engine.core.runner.model.visual.state_dict()
    expected = reference.model.visual.state_dict()
    assert tower.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(tower[name], value), name
    settings = llm.engine.vision.processor_config
    qwen3 = reference.config.model_type.startswith("qwen3_vl")
    assert settings["patch_size"] == (16 if qwen3 else 14) and settings["merge_size"] == 2
    assert settings["image_mean"] == pytest.approx([0.5] * 3 if qwen3 else [0.48145466, 0.4578275, 0.40821073])
    assert (settings["min_pixels"], settings["max_pixels"]) == ((256 * 256, 4096**2) if qwen3 else (3136, 12845056))


def test_without_a_projector_the_text_model_answers_and_an_image_names_where_fw_looked(checkpoint, tmp_path):
    hf, root, reference = checkpoint
    llm = LLM(str(served(root, "", tmp_path)), dtype="float32", device="cpu", num_blocks=8)
    assert llm.engine.vision is None
    assert llm.engine.model_config.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    prompt = [290, 5, 6, 7, 291, 290, 8]
    got = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    with torch.no_grad():
        expected = reference.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    assert got == expected[0, len(prompt) :].tolist()  # M-RoPE with text positions is plain RoPE
    reason = llm.engine.summary["text_only_reason"]
    assert "mmproj*.gguf" in reason and str(tmp_path) in reason and "--mmproj" in reason
    with pytest.raises(ConfigError, match=r"messages\[0\]\.content\[1\]: this model .* does not take images: .*mmproj"):
        llm.chat(conversation(random_image(56, 56, 1)), GREEDY)


def test_mmproj_flag_names_a_projector_elsewhere_or_turns_it_off(checkpoint, tmp_path):
    hf, root, _ = checkpoint
    model = served(root, "F32", tmp_path)
    elsewhere = root / "F16" / "mmproj-F16.gguf"
    llm = LLM(str(model), mmproj=str(elsewhere), dtype="float32", device="cpu", num_blocks=8)
    assert llm.engine.vision is not None and llm.engine.summary["weight_format"] == "gguf"
    off = LLM(str(model), mmproj="none", dtype="float32", device="cpu", num_blocks=8)
    assert off.engine.vision is None and "--mmproj none" in off.engine.summary["text_only_reason"]
    with pytest.raises(ModelLoadError, match="not a llama.cpp vision projector"):
        LLM(str(model), mmproj=str(root / "model-F32.gguf"), dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match="--mmproj names a llama.cpp vision projector for a GGUF model"):
        LLM(str(hf), mmproj=str(elsewhere), dtype="float32", device="cpu")


def test_a_hub_repo_brings_the_preferred_projector_of_the_models_folder(checkpoint, tmp_path, monkeypatch):
    """huggingface_hub's listing and per-file download replaced by a fake repo (no network)."""
    import huggingface_hub

    hf, root, _ = checkpoint
    files = {
        "Q/model-F32.gguf": root / "model-F32.gguf",
        "Q/mmproj-F32.gguf": root / "F32" / "mmproj-F32.gguf",
        "Q/mmproj-F16.gguf": root / "F16" / "mmproj-F16.gguf",
        "mmproj-other-F16.gguf": root / "F16" / "mmproj-F16.gguf",  # another folder's
    }
    snapshot, downloaded = tmp_path / "snapshot", []

    def hf_hub_download(repo_id, filename, *, revision=None, **_):
        downloaded.append(filename)
        (snapshot / filename).parent.mkdir(parents=True, exist_ok=True)
        return str(shutil.copy(files[filename], snapshot / filename))

    def snapshot_download(repo_id, *, revision=None, allow_patterns=None, **_):
        hf_hub_download(repo_id, allow_patterns[0])  # --f's file
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id, **_: ["README.md", *files])
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    llm = LLM("someone/Qwen-VL-GGUF", dtype="float32", device="cpu", num_blocks=8)
    assert downloaded == ["Q/model-F32.gguf", "Q/mmproj-F16.gguf"]  # the projector once the model asks for it
    assert llm.engine.vision is not None and llm.engine.vision.image_token_id == IMAGE_TOKEN_ID
    shutil.rmtree(snapshot)
    downloaded.clear()
    llm = LLM("someone/Qwen-VL-GGUF", file="Q/model-F32.gguf", dtype="float32", device="cpu", num_blocks=8)
    assert downloaded == ["Q/model-F32.gguf", "Q/mmproj-F16.gguf"] and llm.engine.vision is not None
    del files["Q/mmproj-F32.gguf"], files["Q/mmproj-F16.gguf"]
    shutil.rmtree(snapshot)
    llm = LLM("someone/Qwen-VL-GGUF", dtype="float32", device="cpu", num_blocks=8)
    reason = "found none beside model-F32.gguf in the Hub repo someone/Qwen-VL-GGUF (name one with --mmproj PATH)"
    assert llm.engine.vision is None and llm.engine.summary["text_only_reason"].endswith(reason)


def test_a_projector_fw_cannot_use_is_refused_naming_the_valid_ones(checkpoint, tmp_path):
    import gguf

    hf, root, reference = checkpoint
    model = served(root, "", tmp_path)

    def projector(kind: str) -> str:
        (tmp_path / "elsewhere").mkdir(exist_ok=True)
        path = tmp_path / "elsewhere" / f"mmproj-{kind}.gguf"
        writer = gguf.GGUFWriter(str(path), "clip")
        writer.add_clip_has_vision_encoder(True)
        writer.add_clip_projector_type(kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        return str(path)

    with pytest.raises(
        ModelLoadError, match="type 'pixtral' is not supported; supported: qwen2.5vl_merger, qwen3vl_merger, gemma3"
    ):
        LLM(str(model), mmproj=projector("pixtral"), dtype="float32", device="cpu")
    arch = {"qwen2_5_vl": "qwen2vl", "qwen3_vl": "qwen3vl", "qwen3_vl_moe": "qwen3vlmoe"}[reference.config.model_type]
    for other in ("qwen3vl_merger" if arch == "qwen2vl" else "qwen2.5vl_merger", "gemma3"):
        with pytest.raises(ModelLoadError, match=f"a {other} projector goes with a .* text GGUF; this model is {arch}"):
            LLM(str(model), mmproj=projector(other), dtype="float32", device="cpu")
    shutil.copy(projector("pixtral"), tmp_path)  # beside the model: refused, unless --mmproj names another
    with pytest.raises(ModelLoadError, match="type 'pixtral' is not supported"):
        LLM(str(model), dtype="float32", device="cpu")
    assert LLM(str(model), mmproj="none", dtype="float32", device="cpu", num_blocks=8).engine.vision is None


@pytest.mark.gpu
def test_greedy_ids_match_transformers_on_cuda_with_an_f16_projector(checkpoint, tmp_path):
    hf, root, reference = checkpoint
    reference = rounded_tower(reference, "F16")
    llm = LLM(str(served(root, "F16", tmp_path)), dtype="float32", device="cuda", prefill_chunk_size=16)
    images = [random_image(*size) for size in IMAGES]
    results = llm.chat([conversation(*images), conversation(images[1])], GREEDY)
    for result, shown in zip(results, (images, images[1:]), strict=True):
        inputs = reference_inputs(llm, result.prompt_token_ids, shown)
        with torch.no_grad():
            expected = reference.generate(
                **inputs, attention_mask=torch.ones_like(inputs["input_ids"]), max_new_tokens=6, do_sample=False
            )[0, len(result.prompt_token_ids) :].tolist()
        assert result.outputs[0].token_ids == expected
