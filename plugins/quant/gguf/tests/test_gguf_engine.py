"""GGUF models through the whole engine: greedy ids against transformers loading the same file,
the embedded default model, split files, the packed LinearMethod, and load errors."""

from __future__ import annotations

import gguf
import pytest
import torch

from framework import LLM, SamplingParams
from framework.errors import ModelLoadError

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
STEPS = 32


@pytest.fixture(scope="module")
def hf_model():
    """``hf_model(path)``: transformers' model from the GGUF file (fp32), parsed with fw's faster reader."""
    import transformers
    from fw_gguf._fast_reader import FastGGUFReader

    def load(path):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gguf, "GGUFReader", FastGGUFReader)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
            tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return model.eval(), tokenizer

    return load


def hf_greedy(model, prompt_ids: list[int], steps: int = STEPS) -> list[int]:
    """Greedy decoding with transformers' KV cache; EOS is not special (as ignore_eos)."""
    ids, past, out = torch.tensor([prompt_ids]), None, []
    with torch.no_grad():
        for _ in range(steps):
            result = model(ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            next_id = int(result.logits[0, -1].argmax())
            out.append(next_id)
            ids = torch.tensor([[next_id]])
    return out


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_greedy_ids_match_transformers_on_the_real_files(which, request, hf_model, monkeypatch):
    # the dequantize-at-load path, whose matmuls are transformers' own (so the ids are equal over
    # many steps); the packed CPU kernels sum in another order and are tied to this path by
    # test_gguf_cpu_engine.py
    monkeypatch.setenv("FW_GGUF_CPU_PACKED", "0")
    path = request.getfixturevalue(f"{which}_gguf_path")
    reference, hf_tokenizer = hf_model(path)
    llm = LLM(str(path), num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert prompt_ids == [hf_tokenizer(p)["input_ids"] for p in PROMPTS]
    results = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    for ids, result in zip(prompt_ids, results):
        assert result.outputs[0].token_ids == hf_greedy(reference, ids)


def test_default_model_answers_the_capital_of_france():
    llm = LLM(num_blocks=64)  # no model: the embedded SmolLM2-135M-Instruct
    assert llm.engine.summary["weight_format"] == "gguf" and llm.engine.model_config.architecture == "LlamaForCausalLM"
    reply = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=32)
    )[0].outputs[0]
    assert "Paris" in reply.text
    assert reply.finish_reason == "stop"  # <|im_end|> ends the turn


def test_split_gguf_gives_the_same_output_as_the_whole_file(smollm2_gguf_path, split_gguf, tmp_path):
    shards = split_gguf(smollm2_gguf_path, tmp_path, 3, stem="smollm2")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    whole = LLM(str(smollm2_gguf_path), num_blocks=32).generate(PROMPTS[0], params)[0].outputs[0].token_ids
    for source in (str(shards[0]), str(tmp_path)):
        assert LLM(source, num_blocks=32).generate(PROMPTS[0], params)[0].outputs[0].token_ids == whole
    assert (
        LLM(str(tmp_path), file=shards[0].name, num_blocks=32).generate(PROMPTS[0], params)[0].outputs[0].token_ids
        == whole
    )


def test_packed_weights_give_the_same_logits_as_dequantized_ones(smollm2_gguf_path, monkeypatch, check_kept_packed):
    """The packed path (dequantize inside apply, as on GPUs) against the CPU load-time fallback;
    each engine holds its weights the way it says (only GGUF blocks, or only dense matrices)."""
    from fw_gguf.method import GGUFLinearMethod

    from framework.testing import capture_logits

    prompt = {"prompt_token_ids": [1, 504, 3575, 282, 4649, 314]}
    logits = {}
    monkeypatch.setenv("FW_GGUF_CPU_PACKED", "0")  # not the CPU kernels: dequantize at load, or in apply
    for keep in ("0", "1"):
        monkeypatch.setenv("FW_GGUF_KEEP_PACKED", keep)
        llm = LLM(str(smollm2_gguf_path), num_blocks=16)
        model = llm.engine.core.runner.model
        if keep == "1":
            packed = check_kept_packed(model)
            # The file's 30 blocks each hold q/k/v, attn_output, ffn_gate/ffn_up and ffn_down, which
            # fill four layers (qkv_proj, o_proj, gate_up_proj, down_proj); token_embd fills the
            # embedding. It has no output.weight: the head is tied, reuses the embedding's table and
            # has no GGUF layer of its own. The norms are plain tensors. So 4 * 30 + 1 = 121 layers.
            per_block = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
            assert len(model.model.layers) == 30 and len(packed) == 4 * 30 + 1
            assert set(packed) == {"model.embed_tokens"} | {
                f"model.layers.{i}.{name}" for i in range(30) for name in per_block
            }
        else:
            layers = [m for m in model.modules() if isinstance(getattr(m, "linear_method", None), GGUFLinearMethod)]
            assert layers and all(
                layer.gguf_dense.dtype == torch.float32 and not hasattr(layer, "gguf_weight_0") for layer in layers
            )
        records = capture_logits(llm)
        llm.generate(prompt, SamplingParams(max_tokens=1))
        logits[keep] = torch.stack([records[key] for key in sorted(records)])
    assert torch.equal(logits["0"], logits["1"])


def test_mixed_type_fused_layer_keeps_one_buffer_per_shard(gemma3_gguf_path, monkeypatch, check_kept_packed):
    monkeypatch.setenv("FW_GGUF_KEEP_PACKED", "1")
    llm = LLM(str(gemma3_gguf_path), num_blocks=16)
    model = llm.engine.core.runner.model
    assert "model.layers.0.self_attn.qkv_proj" in check_kept_packed(model)
    qkv = model.model.layers[0].self_attn.qkv_proj
    names = [t.name for t in qkv.gguf_types]
    assert len(names) == 3 and len(set(names)) > 1, names  # Q4_K_M: q/k and v differ
    from fw_gguf.reader import open_gguf

    tensors = open_gguf(gemma3_gguf_path).tensors
    for index, x in enumerate("qkv"):  # each shard holds the file's own bytes
        assert torch.equal(
            getattr(qkv, f"gguf_weight_{index}"), torch.as_tensor(tensors[f"blk.0.attn_{x}.weight"].data)
        )
    expected = torch.cat([tensors[f"blk.0.attn_{x}.weight"].dequantize() for x in "qkv"])
    assert torch.equal(qkv.linear_method.dequantized(qkv, torch.float32), expected)


def test_broken_files_fail_with_the_file_named(smollm2_gguf_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_gguf_path.read_bytes()[:5_000_000])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        LLM(str(cut))
    fake = tmp_path / "fake.gguf"
    fake.write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ModelLoadError, match="fake.gguf.*not a GGUF file"):
        LLM(str(fake))
    (tmp_path / "other").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "other" / name).write_bytes(smollm2_gguf_path.read_bytes()[:64])
    with pytest.raises(ModelLoadError, match="--f"):
        LLM(str(tmp_path / "other"))


def test_hub_repo_with_file_loads_from_the_cache_offline(smollm2_gguf_path, tmp_path, monkeypatch):
    """``--m owner/repo --f file.gguf`` resolves through huggingface_hub's cache (offline)."""
    import os

    import huggingface_hub.constants as constants

    commit = "89abcdef0123456789abcdef0123456789abcdef"
    repo = tmp_path / "hub" / "models--fwtest--smollm2-gguf"
    (repo / "snapshots" / commit / "quant").mkdir(parents=True)
    os.symlink(smollm2_gguf_path, repo / "snapshots" / commit / "quant" / "model-q4_1.gguf")
    os.symlink(smollm2_gguf_path, repo / "snapshots" / commit / "mmproj-model-f16.gguf")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = LLM(str(smollm2_gguf_path), num_blocks=16).generate(PROMPTS[0], params)[0].outputs[0].token_ids
    for file in ("quant/model-q4_1.gguf", "quant"):
        llm = LLM("fwtest/smollm2-gguf", file=file, num_blocks=16)
        assert llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids == expected


def test_gemma3_packed_and_dequantized_paths_give_the_same_greedy_tokens(gemma3_gguf_path, monkeypatch):
    """Q4_K / Q5_0 / Q6_K / Q8_0 layers kept packed (dequantized in every apply, as the GPU's
    fallback) against the CPU's dequantize-at-load path."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    monkeypatch.setenv("FW_GGUF_CPU_PACKED", "0")
    for keep in ("0", "1"):
        monkeypatch.setenv("FW_GGUF_KEEP_PACKED", keep)
        llm = LLM(str(gemma3_gguf_path), num_blocks=16)
        tokens[keep] = [r.outputs[0].token_ids for r in llm.generate(PROMPTS[:2], params)]
    assert tokens["0"] == tokens["1"] and all(len(ids) == 8 for ids in tokens["0"])
