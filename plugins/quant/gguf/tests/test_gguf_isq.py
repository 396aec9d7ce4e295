"""``--isq q4_0 .. q6k``: fw's GGUF quantizers against references, the Q4_K_M recipe, and a tiny
random Llama served with ``--isq`` against transformers on the quantize-dequantized weights.

References: gguf-py's quantizers for the simple types (bit for bit); for the K-quants, which gguf-py
cannot quantize, a scalar transliteration of llama.cpp's ``quantize_row_q*_K_ref``
(:mod:`kquant_reference`, bit for bit; the comparison against ``llama-quantize`` itself is
``benchmarks/isq_vs_llamacpp.py``); gguf-py's dequantizers for the error bounds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from fw_gguf.dequant import dequantize
from fw_gguf.isq import tensor_types, use_more_bits
from fw_gguf.quantize import quantize
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from framework import LLM, SamplingParams
from framework.testing import reference_greedy, write_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
import kquant_reference  # noqa: E402

SIMPLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
#: Relative RMS error (of N(0, 1) weights) each type must stay under: llama.cpp's own quantizers
#: measure about 0.086 (Q4_0), 0.079 (Q4_1), 0.043 (Q5_0), 0.038 (Q5_1), 0.0054 (Q8_0),
#: 0.30 (Q2_K), 0.15 (Q3_K), 0.072 (Q4_K), 0.036 (Q5_K), 0.018 (Q6_K) on such weights.
ERROR_BOUNDS = {
    Q.Q4_0: 0.09,
    Q.Q4_1: 0.082,
    Q.Q5_0: 0.045,
    Q.Q5_1: 0.04,
    Q.Q8_0: 0.006,
    Q.Q2_K: 0.31,
    Q.Q3_K: 0.16,
    Q.Q4_K: 0.075,
    Q.Q5_K: 0.038,
    Q.Q6_K: 0.019,
}


def awkward_rows(k: int, seed: int = 0) -> torch.Tensor:
    """Rows that reach the quantizers' corner cases: Gaussian, all-zero blocks, one sign only,
    a few repeated values, heavy tails, and one large block beside small ones."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(6, k, generator=g) * 0.02
    rows[0, :32] = 0
    rows[1, k // 2 :] *= 50
    rows[2] = rows[2].abs()
    rows[3] = -rows[3].abs()
    rows[4, : k // 2] = torch.randint(-3, 4, (k // 2,), generator=g) * 0.01
    rows[5] = torch.rand(k, generator=g) ** 4 * 0.1
    return rows


@pytest.mark.parametrize("qtype", SIMPLE, ids=lambda t: t.name)
def test_simple_types_match_gguf_py_bit_for_bit(qtype):
    rows = awkward_rows(512)
    assert np.array_equal(quantize(rows, qtype).numpy(), gguf.quants.quantize(rows.numpy(), qtype))


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quants_match_llama_cpp_reference_quantizer_bit_for_bit(qtype):
    rows = awkward_rows(512, seed=int(qtype))
    expected = kquant_reference.quantize_rows(rows.numpy(), qtype.name)
    assert np.array_equal(quantize(rows, qtype).numpy(), expected)


@pytest.mark.parametrize("qtype", SIMPLE + K_QUANTS, ids=lambda t: t.name)
def test_quantized_blocks_dequantize_within_the_types_error(qtype):
    weight = torch.randn(64, 1024, generator=torch.Generator().manual_seed(3))
    blocks = quantize(weight.to(torch.bfloat16), qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype))
    ours = dequantize(blocks, qtype, tuple(weight.shape), torch.float32)
    assert torch.equal(ours, reference)  # fw's dequantizer reads the blocks as gguf-py does
    source = weight.to(torch.bfloat16).float()
    relative = ((reference - source).pow(2).mean().sqrt() / source.std()).item()
    assert relative < ERROR_BOUNDS[qtype]


def test_use_more_bits_picks_llama_cpps_layers():
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


def test_q4k_recipe_is_q4_k_m():
    shapes = {"model.embed_tokens.weight": (32000, 4096), "lm_head.weight": (32000, 4096), "model.norm.weight": (4096,)}
    for i in range(32):
        for leaf, shape in (
            ("self_attn.q_proj", (4096, 4096)),
            ("self_attn.v_proj", (1024, 4096)),
            ("mlp.down_proj", (4096, 14336)),
            ("mlp.gate_proj", (14336, 4096)),
            ("input_layernorm", (4096,)),
        ):
            shapes[f"model.layers.{i}.{leaf}.weight"] = shape
    types = tensor_types("q4k", shapes, 32, tie_word_embeddings=False)
    assert types["lm_head.weight"] == "Q6_K" and types["model.embed_tokens.weight"] == "Q4_K"
    assert "model.norm.weight" not in types and "model.layers.0.input_layernorm.weight" not in types
    six_bit = [i for i in range(32) if use_more_bits(i, 32)]
    for i in range(32):
        expected = "Q6_K" if i in six_bit else "Q4_K"
        assert types[f"model.layers.{i}.self_attn.v_proj.weight"] == expected
        assert types[f"model.layers.{i}.mlp.down_proj.weight"] == expected
        assert types[f"model.layers.{i}.self_attn.q_proj.weight"] == "Q4_K"


def test_k_quant_fallbacks_for_widths_not_a_multiple_of_256():
    shapes = {
        "model.embed_tokens.weight": (1000, 640),
        "model.layers.0.self_attn.q_proj.weight": (640, 640),
        "model.layers.0.mlp.down_proj.weight": (640, 2048),
        "model.layers.0.mlp.up_proj.weight": (2048, 48),
    }
    types = tensor_types("q4k", shapes, 1, tie_word_embeddings=True)
    assert types == {
        "model.embed_tokens.weight": "Q8_0",  # the tied head: Q8_0 where Q6_K cannot hold the rows
        "model.layers.0.self_attn.q_proj.weight": "Q5_0",  # llama.cpp's Q4_K fallback
        "model.layers.0.mlp.down_proj.weight": "Q6_K",
    }  # 48 wide: no 32-value blocks, stays 16-bit
    assert tensor_types("q5k", shapes, 1, True)["model.layers.0.self_attn.q_proj.weight"] == "Q5_1"
    assert tensor_types("q6k", shapes, 1, True)["model.layers.0.self_attn.q_proj.weight"] == "Q8_0"


# --- serving a tiny random Llama with --isq -------------------------------------------------

CONFIG = dict(
    vocab_size=160,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)
PROMPTS = [[5, 9, 33, 2, 71], list(range(40, 59))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-bf16")
    reference = write_tiny_model(path, transformers.LlamaConfig(**CONFIG, torch_dtype="bfloat16"))
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path, reference


@pytest.mark.parametrize("isq", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2k", "q3k", "q4k", "q5k", "q6k"])
def test_isq_tiny_llama_matches_transformers_on_the_dequantized_weights(isq, tiny_llama):
    path, reference = tiny_llama
    config = json.loads((path / "config.json").read_text())
    shapes = {name: tuple(t.shape) for name, t in load_file(str(path / "model.safetensors")).items()}
    types = tensor_types(isq, shapes, config["num_hidden_layers"], config.get("tie_word_embeddings", False))
    state = {}
    for name, tensor in load_file(str(path / "model.safetensors")).items():
        if name in types:  # what the quantized blocks stand for, read back by gguf-py
            blocks = quantize(tensor, Q[types[name]]).numpy()
            tensor = torch.from_numpy(gguf.quants.dequantize(blocks, Q[types[name]])).view(tensor.shape)
        state[name] = tensor.float()
    reference.load_state_dict(state, strict=False)
    expected = [reference_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS]
    with LLM(str(path), device="cpu", dtype="float32", num_blocks=16, isq=isq) as llm:
        assert llm.engine.summary["isq"].startswith(f"--isq {isq}: quantized {len(types)} tensors")
        layer = llm.engine.core.runner.model.model.layers[1].mlp.down_proj
        assert [t.name for t in layer.gguf_types] == [types["model.layers.1.mlp.down_proj.weight"]]
        results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [r.outputs[0].token_ids for r in results] == expected


# --- the recipe against llama.cpp's own files, and fw quantize --isq writing GGUF ---------------


def _file_recipe(path):
    from fw_gguf.format import GGUFFormat

    source = GGUFFormat(path)
    shapes = {source._names[n]: tuple(info.shape) for n, info in source.model.tensors.items() if n in source._names}
    config = source.hf_config()
    return source.quantization_config()["tensor_types"], shapes, config


@pytest.mark.parametrize(("fixture", "isq"), [("gemma3_gguf_path", "q4k"), ("smollm2_gguf_path", "q4_1")])
def test_recipe_gives_every_tensor_the_type_llama_quantize_gave_it(fixture, isq, request):
    """Gemma 3 270M Q4_K_M (Q4_K, Q6_K for some v/down, Q5_0 / Q8_0 fallbacks for 640-wide rows)
    and SmolLM2 Q4_1 (its tied head Q8_0) as llama-quantize wrote them."""
    file_types, shapes, config = _file_recipe(request.getfixturevalue(fixture))
    ours = tensor_types(isq, shapes, config["num_hidden_layers"], config.get("tie_word_embeddings", True))
    assert ours == file_types


@pytest.fixture(scope="module")
def tiny_llama_bpe(tmp_path_factory, smollm2_gguf_path):
    """A tiny random bf16 Llama with SmolLM2's byte-level BPE tokenizer (what a GGUF file can carry)."""
    from fw_gguf.format import GGUFFormat

    path = tmp_path_factory.mktemp("tiny-llama-bpe")
    config = dict(CONFIG, vocab_size=49152, tie_word_embeddings=True, torch_dtype="bfloat16")
    write_tiny_model(path, transformers.LlamaConfig(**config))
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(path / "model.safetensors"))
    tokenizer = GGUFFormat(smollm2_gguf_path).tokenizer()
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": tokenizer.bos_token,
                "eos_token": tokenizer.eos_token,
                "chat_template": tokenizer.chat_template,
            }
        )
    )
    return path


def test_fw_quantize_isq_writes_a_gguf_fw_loads_back_with_identical_outputs(tiny_llama_bpe, tmp_path):
    from fw_gguf.reader import open_gguf_model

    from framework.isq import export_checkpoint
    from framework.testing import capture_logits

    written, report = export_checkpoint(str(tiny_llama_bpe), str(tmp_path / "tiny-q4k.gguf"), "q4k", "cpu")
    assert report.num_quantized == 2 * 7 + 1  # the linears and the (tied) token embedding
    model = open_gguf_model(written)
    assert model.metadata["general.architecture"] == "llama" and model.metadata["general.file_type"] == 15
    assert model.metadata["tokenizer.ggml.model"] == "gpt2" and len(model.metadata["tokenizer.ggml.tokens"]) == 49152
    # fw reads SmolLM2's file with GPT-2's bare byte-level split (same ids): a name llama.cpp knows
    assert model.metadata["tokenizer.ggml.pre"] == "gpt-2"
    assert model.tensors["blk.1.attn_v.weight"].qtype.name == "Q6_K"  # use_more_bits(1, 2): the last eighth
    assert model.tensors["blk.0.attn_v.weight"].qtype.name == "Q4_K"
    assert "output.weight" not in model.tensors  # tied, as llama.cpp writes it

    prompts = ["The capital of France is", "def fibonacci(n):"]
    outputs = {}
    for key, source, options in (("isq", tiny_llama_bpe, {"isq": "q4k"}), ("file", written, {})):
        with LLM(str(source), device="cpu", dtype="float32", num_blocks=16, **options) as llm:
            records = capture_logits(llm)
            results = llm.generate(prompts, GREEDY)
            logits = torch.stack([records[k] for k in sorted(records, key=lambda k: (str(k[0]), k[1]))])
            outputs[key] = ([r.outputs[0].token_ids for r in results], logits)
    assert outputs["isq"][0] == outputs["file"][0]
    assert torch.equal(outputs["isq"][1], outputs["file"][1])


def test_pre_tokenizer_names_are_llama_cpps():
    from fw_gguf.tokenizer import _LLAMA3_SPLIT
    from fw_gguf.writer import llama_cpp_pre_tokenizer
    from tokenizers import Regex, pre_tokenizers

    from framework.errors import ConfigError

    def spec(pre):
        return json.loads(pre.__getstate__())

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert llama_cpp_pre_tokenizer(spec(byte_level)) == "gpt-2"  # llama.cpp refuses "gpt2"
    smollm = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    assert llama_cpp_pre_tokenizer(spec(smollm)) == "smollm"
    split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
    llama3 = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert llama_cpp_pre_tokenizer(spec(llama3)) == "llama-bpe"
    with pytest.raises(ConfigError, match="no llama.cpp pre-tokenizer matches.*Whitespace"):
        llama_cpp_pre_tokenizer(spec(pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), byte_level])))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", SIMPLE + K_QUANTS, ids=lambda t: t.name)
def test_quantizers_on_cuda_write_the_blocks_they_write_on_the_cpu(qtype):
    """The searches use only correctly rounded float32 operations, so the device does not change a bit."""
    rows = awkward_rows(1024, seed=7)
    assert torch.equal(quantize(rows.cuda(), qtype).cpu(), quantize(rows, qtype))


@pytest.mark.gpu
@pytest.mark.parametrize("isq", ["q4k", "q8_0", "q6k"])
def test_isq_on_cuda_serves_the_tokens_of_the_file_fw_quantize_writes(isq, tiny_llama_bpe, tmp_path):
    from framework.isq import export_checkpoint

    written, _ = export_checkpoint(str(tiny_llama_bpe), str(tmp_path / f"tiny-{isq}.gguf"), isq, "cuda")
    tokens = {}
    for key, source, options in (("isq", tiny_llama_bpe, {"isq": isq}), ("file", written, {})):
        with LLM(str(source), device="cuda", dtype="bfloat16", num_blocks=16, **options) as llm:
            results = llm.generate(["The capital of France is", "def fibonacci(n):"], GREEDY)
            tokens[key] = [r.outputs[0].token_ids for r in results]
    assert tokens["isq"] == tokens["file"]
