"""Llama 4 text (`llama4`) from GGUF files laid out as llama.cpp's converter writes them.

A tiny random Llama 4 (MoE with a shared expert on every second layer, top-1 of 4 experts, the
QK norm, a NoPE layer every fourth) is written as a GGUF by hand, the converter's way: the
dense and expert widths swapped into `feed_forward_length` / `expert_feed_forward_length`, the
`[E, H, 2I]` expert stack split and transposed into `ffn_gate_exps` / `ffn_up_exps`, q/k left
unpermuted. The reference's config takes the values llama.cpp hard-codes (chunks of 8192, NoPE
every 4th layer, `floor_scale` 8192, `attn_scale` 0.1). fw's logits from the F32 file equal
transformers'; a Q8_0 file gives the greedy ids of transformers holding the file's values.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import transformers
from fw_gguf.config import hf_config_from_gguf

from framework import LLM, SamplingParams
from framework.errors import ModelLoadError
from framework.testing import (
    PARITY_PROMPTS,
    check_logits_parity,
    random_causal_lm,
    reference_greedy,
    tiny_llama4_text,
)

sys.path.insert(0, str(Path(__file__).parent))
from gguf_test_writer import model_holding, write_gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = tiny_llama4_text(
    # what llama.cpp hard-codes for llama4 files
    no_rope_layer_interval=4,
    attention_chunk_size=8192,
    floor_scale=8192,
    attn_scale=0.1,
    # Scout's llama3 RoPE scaling (low == high), stored by the converter as rope_freqs factors
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 16.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 1.0,
        "original_max_position_embeddings": 64,
    },
)
_GLOBAL = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "feed_forward.router": "ffn_gate_inp",
    "feed_forward.gate_proj": "ffn_gate",
    "feed_forward.up_proj": "ffn_up",
    "feed_forward.down_proj": "ffn_down",
    "feed_forward.shared_expert.gate_proj": "ffn_gate_shexp",
    "feed_forward.shared_expert.up_proj": "ffn_up_shexp",
    "feed_forward.shared_expert.down_proj": "ffn_down_shexp",
}


def rope_freqs(config) -> torch.Tensor:
    """The converter's ``rope_freqs`` for a llama3 scaling whose ``low_freq_factor == high_freq_factor``:
    1 for the pairs of wavelength below ``original_max_position_embeddings``, ``factor`` above."""
    params, dim = config.rope_parameters, config.head_dim
    wavelengths = 2 * math.pi * params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return torch.where(wavelengths < params["original_max_position_embeddings"], 1.0, params["factor"]).float()


def gguf_tensors(model) -> dict[str, torch.Tensor]:
    """transformers' state dict under llama.cpp's names and layouts (its ``Llama4Model`` converter)."""
    tensors = {"rope_freqs.weight": rope_freqs(model.config)}
    for name, tensor in model.state_dict().items():
        if name in _GLOBAL:
            tensors[f"{_GLOBAL[name]}.weight"] = tensor
            continue
        _, _, index, rest = name.split(".", 3)
        block = f"blk.{index}"
        if rest == "feed_forward.experts.gate_up_proj":  # [E, H, 2I] -> [E, 2I, H] -> gate, up [E, I, H]
            gate, up = tensor.transpose(-1, -2).chunk(2, dim=-2)
            tensors[f"{block}.ffn_gate_exps.weight"], tensors[f"{block}.ffn_up_exps.weight"] = gate, up
        elif rest == "feed_forward.experts.down_proj":  # [E, I, H] -> [E, H, I]
            tensors[f"{block}.ffn_down_exps.weight"] = tensor.transpose(-1, -2)
        else:
            module, suffix = rest.rsplit(".", 1)
            tensors[f"{block}.{_LAYER[module]}.{suffix}"] = tensor
    return tensors


def hf_values(stored: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The file's values back under transformers' names and layouts (the inverse of ``gguf_tensors``)."""
    names = {f"{gguf}.weight": hf for hf, gguf in _GLOBAL.items()}
    for i in range(num_layers):
        names.update({f"blk.{i}.{gguf}.weight": f"model.layers.{i}.{hf}.weight" for hf, gguf in _LAYER.items()})
    values = {names[name]: tensor for name, tensor in stored.items() if name in names}
    for i in range(num_layers):
        prefix, block = f"model.layers.{i}.feed_forward.experts", f"blk.{i}"
        if f"{block}.ffn_down_exps.weight" in stored:
            gate_up = torch.cat([stored[f"{block}.ffn_gate_exps.weight"], stored[f"{block}.ffn_up_exps.weight"]], 1)
            values[f"{prefix}.gate_up_proj"] = gate_up.transpose(-1, -2)
            values[f"{prefix}.down_proj"] = stored[f"{block}.ffn_down_exps.weight"].transpose(-1, -2)
    return values


def metadata(config, skip: str | None = None):
    """The converter's `llama4.*` keys for ``config`` (one left out when ``skip`` names it)."""

    def add(writer) -> None:
        keys = {
            "block_count": config.num_hidden_layers,
            "context_length": config.max_position_embeddings,
            "embedding_length": config.hidden_size,
            "feed_forward_length": config.intermediate_size_mlp,  # the converter swaps the two widths
            "expert_feed_forward_length": config.intermediate_size,
            "attention.head_count": config.num_attention_heads,
            "attention.head_count_kv": config.num_key_value_heads,
            "attention.key_length": config.head_dim,
            "attention.value_length": config.head_dim,
            "rope.dimension_count": config.head_dim,
            "expert_count": config.num_local_experts,
            "expert_used_count": config.num_experts_per_tok,
            "interleave_moe_layer_step": config.interleave_moe_layer_step,
            "vocab_size": config.vocab_size,
        }
        for name, value in keys.items():
            if name != skip:
                writer.add_uint32(f"llama4.{name}", value)
        writer.add_float32("llama4.rope.freq_base", config.rope_parameters["rope_theta"])
        writer.add_float32("llama4.attention.layer_norm_rms_epsilon", config.rms_norm_eps)

    return add


@pytest.fixture(scope="module")
def reference():
    return random_causal_lm(transformers.Llama4TextConfig(**CONFIG))


def test_f32_gguf_gives_the_logits_of_transformers(reference, tmp_path):
    config = reference.config
    write_gguf(tmp_path / "model-f32.gguf", "llama4", gguf_tensors(reference), metadata(config), config.vocab_size)
    llm = check_logits_parity(tmp_path / "model-f32.gguf", reference, PARITY_PROMPTS[:2])
    model = llm.engine.core.runner.model
    assert llm.engine.model_config.architecture == "Llama4ForCausalLM"
    layers = model.model.layers
    assert [hasattr(layer.feed_forward, "experts") for layer in layers] == [False, True, False, True]
    assert [layer.self_attn.rotary_emb is not None for layer in layers] == [True, True, True, False]
    assert {layer.self_attn.attn.config.attention_chunk_size for layer in layers[:3]} == {8192}
    assert all(layer.self_attn.use_qk_norm for layer in layers[:3])
    assert set(rope_freqs(reference.config).tolist()) == {1.0, 16.0}  # both kinds of pairs in the file
    assert layers[0].self_attn.rotary_emb.factor == 16.0


#: What the Q8_0 file quantizes: experts, shared expert, router, dense MLP and attention output.
QUANTIZED = ("_exps", "_shexp", "ffn_gate_inp", "ffn_up.", "ffn_down.", "attn_output")


def test_q8_experts_stay_packed_and_give_the_greedy_ids_of_the_files_values(
    reference, tmp_path, monkeypatch, check_kept_packed
):
    config = reference.config
    path = tmp_path / "model-q8.gguf"
    stored = write_gguf(path, "llama4", gguf_tensors(reference), metadata(config), config.vocab_size, QUANTIZED)
    dequantized = model_holding(reference, hf_values(stored, config.num_hidden_layers))
    monkeypatch.setenv("FW_GGUF_KEEP_PACKED", "1")
    llm = LLM(str(path), num_blocks=16, prefill_chunk_size=8)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in PARITY_PROMPTS[:2]], greedy)
    assert [r.outputs[0].token_ids for r in results] == [
        reference_greedy(dequantized, p, greedy.max_tokens) for p in PARITY_PROMPTS[:2]
    ]
    packed = check_kept_packed(llm.engine.core.runner.model)
    assert {"model.layers.1.feed_forward.shared_expert.down_proj", "model.layers.1.feed_forward.router"} <= set(packed)


def test_sliding_window_zero_means_rope_and_full_attention_everywhere():
    """MobileLLM-R1's files (`attention.sliding_window` 0): llama.cpp turns off chunks and NoPE layers."""
    md = {"general.architecture": "llama4", "tokenizer.ggml.tokens": ["a"] * 8}
    writer = _KeyRecorder(md)
    metadata(transformers.Llama4TextConfig(**CONFIG))(writer)
    md["llama4.attention.sliding_window"] = 0
    config = hf_config_from_gguf(md)
    assert config["no_rope_layers"] == [1, 1, 1, 1] and config["attention_chunk_size"] is None
    assert set(config["layer_types"]) == {"full_attention"}
    md["llama4.expert_count"] = 128  # Maverick: llama.cpp drops the QK norm
    assert hf_config_from_gguf(md)["use_qk_norm"] is False


def test_missing_interleave_step_is_named(reference, tmp_path):
    config = reference.config
    path = tmp_path / "no-step.gguf"
    write_gguf(path, "llama4", gguf_tensors(reference), metadata(config, skip="interleave_moe_layer_step"), 160)
    with pytest.raises(ModelLoadError, match="llama4.interleave_moe_layer_step"):
        LLM(str(path), num_blocks=16)


class _KeyRecorder:
    """A stand-in for ``GGUFWriter`` that records ``add_uint32`` / ``add_float32`` into a dict."""

    def __init__(self, md: dict) -> None:
        self.md = md

    def add_uint32(self, key: str, value) -> None:
        self.md[key] = value

    add_float32 = add_uint32


#: Llama 4's tokenizer.json split (GPT-4o's o200k regex, as llama.cpp's llama-vocab.cpp quotes it)
O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def test_llama4_pre_tokenizer_splits_as_gpt_4o():
    """`tokenizer.ggml.pre` "llama4": the text splits as the o200k regex splits it (Python's
    ``regex``), before the byte-level mapping."""
    import regex
    from fw_gguf.tokenizer import _byte_to_unicode, tokenizer_from_gguf

    tokens = ["<s>", "</s>", "a", "b", "ab"]
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["a b"],
    }
    pre_tokenizer = tokenizer_from_gguf(metadata).pre_tokenizer
    spell = _byte_to_unicode()
    for text in ["Hello World's DON'T stop 12345\n\n  x", "CamelCaseWord über-Straße /path/\n", "a\u0301b ÉCOLE 3.14"]:
        expected = ["".join(spell[b] for b in piece.encode()) for piece in regex.findall(O200K, text)]
        assert [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)] == expected, text


@pytest.mark.gpu
def test_gpu_packed_experts_in_cuda_graphs_give_the_greedy_ids_of_the_files_values(reference, tmp_path):
    """On the GPU the Q8_0 experts stay packed (GGUFFusedMoEMethod, each top-k choice its own call
    on its scaled input) through CUDA-graphed decode steps; one sequence and six at once."""
    from fw_gguf.moe import GGUFFusedMoEMethod

    config, path = reference.config, tmp_path / "model-q8.gguf"
    stored = write_gguf(path, "llama4", gguf_tensors(reference), metadata(config), config.vocab_size, QUANTIZED)
    dequantized = model_holding(reference, hf_values(stored, config.num_hidden_layers))
    prompts = [*PARITY_PROMPTS[:2], *([3 + i, 17, 29 + i] for i in range(4))]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(path), device="cuda", dtype="f32", num_blocks=64)
    assert "decode graphs" in llm.engine.summary["cuda_graphs"]
    experts = llm.engine.core.runner.model.model.layers[1].feed_forward.experts
    assert isinstance(experts.quant_method, GGUFFusedMoEMethod)
    for batch in ([prompts[0]], prompts):
        ids = [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in batch], greedy)]
        assert ids == [reference_greedy(dequantized, p, greedy.max_tokens) for p in batch]
