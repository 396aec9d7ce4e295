"""Random-weight GGUF files of real model shapes that llama.cpp and fw both load (for benchmarks).

:func:`write_random_gguf` writes a Hugging Face style shape (``common.SHAPES``: Llama or Qwen3-MoE)
as llama.cpp's converter lays it out: its metadata keys and tensor names, norms and the MoE
router in F32, weight matrices in F16, F32 or Q8_0, and a byte-level BPE vocabulary of the
shape's size (the 256 byte symbols, ASCII filler tokens, a few merges, control tokens at the end)
that both tokenizers accept. Values are drawn on the GPU when there is one and streamed to the
file one tensor at a time (a Llama-3-8B F16 file never sits in host memory whole).
:func:`requantize` stands in for ``llama-quantize`` where it is not built: it re-encodes the
weight matrices with ``gguf.quants`` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; no K-quants).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

GGUF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3moe"}
SOURCE_TYPES = (Q.F16, Q.F32, Q.Q8_0)
PYTHON_QUANT_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
_FILE_TYPES = {
    Q.F32: gguf.LlamaFileType.ALL_F32,
    Q.F16: gguf.LlamaFileType.MOSTLY_F16,
    Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
}


def tensor_layout(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """``(GGUF name, shape outermost first, kind)`` of every tensor; kind is ``norm``, ``router`` or ``weight``."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads, vocab = config["num_key_value_heads"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // heads
    is_moe = "num_experts" in config
    tensors = [("token_embd.weight", (vocab, hidden), "weight")]
    for i in range(config["num_hidden_layers"]):
        b = f"blk.{i}."
        tensors += [
            (b + "attn_norm.weight", (hidden,), "norm"),
            (b + "attn_q.weight", (heads * head_dim, hidden), "weight"),
            (b + "attn_k.weight", (kv_heads * head_dim, hidden), "weight"),
            (b + "attn_v.weight", (kv_heads * head_dim, hidden), "weight"),
            (b + "attn_output.weight", (hidden, heads * head_dim), "weight"),
            (b + "ffn_norm.weight", (hidden,), "norm"),
        ]
        if is_moe:
            experts, width = config["num_experts"], config["moe_intermediate_size"]
            tensors += [
                (b + "attn_q_norm.weight", (head_dim,), "norm"),
                (b + "attn_k_norm.weight", (head_dim,), "norm"),
                (b + "ffn_gate_inp.weight", (experts, hidden), "router"),
                (b + "ffn_gate_exps.weight", (experts, width, hidden), "weight"),
                (b + "ffn_up_exps.weight", (experts, width, hidden), "weight"),
                (b + "ffn_down_exps.weight", (experts, hidden, width), "weight"),
            ]
        else:
            width = config["intermediate_size"]
            tensors += [
                (b + "ffn_gate.weight", (width, hidden), "weight"),
                (b + "ffn_up.weight", (width, hidden), "weight"),
                (b + "ffn_down.weight", (hidden, width), "weight"),
            ]
    tensors.append(("output_norm.weight", (hidden,), "norm"))
    if not config.get("tie_word_embeddings", False):
        tensors.append(("output.weight", (vocab, hidden), "weight"))
    return tensors


def vocabulary(vocab_size: int) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    """Tokens, token types, merges and the special token ids of a byte-level BPE vocabulary.

    The 256 byte symbols come first (so every text encodes), then ``"Ġt"``-style merged pairs, then
    ASCII fillers (llama.cpp maps each character of a token back to a byte: fillers stay within
    the byte symbols), then control tokens: the last 256 (8 in a vocabulary under 4096), the first
    two of which are BOS and EOS.
    """
    byte_symbols = list(_byte_symbols().values())
    merges = [f"{a} {b}" for a, b in (("Ġ", "t"), ("Ġ", "a"), ("h", "e"), ("i", "n"), ("Ġt", "he"))]
    merged = ["Ġt", "Ġa", "he", "in", "Ġthe"]
    num_special = 256 if vocab_size >= 4096 else 8
    fillers = [f"x{i}" for i in range(vocab_size - num_special - len(byte_symbols) - len(merged))]
    special = ["<|begin_of_text|>", "<|end_of_text|>"] + [
        f"<|reserved_special_token_{i}|>" for i in range(num_special - 2)
    ]
    tokens = byte_symbols + merged + fillers + special
    types = [int(gguf.TokenType.NORMAL)] * (len(tokens) - num_special) + [int(gguf.TokenType.CONTROL)] * num_special
    first_special = len(tokens) - num_special
    return tokens, types, merges, {"bos": first_special, "eos": first_special + 1}


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable symbol map (bytes_to_unicode)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return symbols


def _add_metadata(writer: gguf.GGUFWriter, arch: str, config: dict[str, Any], weight_type: Q) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_name(f"random {arch} {config['hidden_size']}x{config['num_hidden_layers']}")
    writer.add_file_type(int(_FILE_TYPES[weight_type]))
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    if "num_experts" in config:
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    tokens, types, merges, special = vocabulary(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen3moe" else "llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(special["bos"])
    writer.add_eos_token_id(special["eos"])
    writer.add_add_bos_token(True)


def quantize_q8_0(values: torch.Tensor) -> torch.Tensor:
    """``values`` (last dimension a multiple of 32) as Q8_0 blocks, uint8 ``[..., 34 * n / 32]``, on
    their device; the same bytes as ``gguf.quants.quantize(values, Q8_0)`` (round half away from zero)."""
    blocks = values.float().reshape(-1, 32)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    scaled = blocks * inverse
    quants = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)
    packed = torch.cat([scale.half().view(torch.uint8), quants.view(torch.uint8)], dim=1)
    return packed.reshape(*values.shape[:-1], values.shape[-1] // 32 * 34)


def _nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * size


def write_random_gguf(
    path: Path, config: dict[str, Any], weight_type: Q = Q.F16, seed: int = 0, device: str | None = None
) -> Path:
    """Write ``config``'s shape with random weights (normal, std 0.02; norms near 1) to ``path``."""
    if weight_type not in SOURCE_TYPES:
        raise ValueError(
            f"weight type {weight_type.name} cannot be written directly; choose one of "
            f"{', '.join(t.name for t in SOURCE_TYPES)}"
        )
    arch = GGUF_ARCHITECTURES[config["architectures"][0]]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device).manual_seed(seed)
    layout = [
        (name, shape, Q.F32 if kind != "weight" else weight_type, kind) for name, shape, kind in tensor_layout(config)
    ]
    writer = gguf.GGUFWriter(path, arch)
    _add_metadata(writer, arch, config, weight_type)
    for name, shape, qtype, _ in layout:
        stored = shape if qtype in (Q.F16, Q.F32) else (*shape[:-1], _nbytes(shape[-1:], qtype))
        dtype = {Q.F16: np.float16, Q.F32: np.float32}.get(qtype, np.uint8)
        writer.add_tensor_info(name, stored, np.dtype(dtype), _nbytes(shape, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, shape, qtype, kind in layout:
        values = torch.randn(shape, generator=generator, device=device)
        values = 1.0 + 0.01 * values if kind == "norm" else 0.02 * values
        if qtype == Q.Q8_0:
            values = quantize_q8_0(values)
        elif qtype == Q.F16:
            values = values.half()
        writer.write_tensor_data(values.cpu().numpy())
    writer.close()
    return path


def requantize(source: Path, target: Path, qtype: Q) -> Path:
    """``source`` with its weight matrices re-encoded as ``qtype`` by ``gguf.quants`` (norms and the
    MoE router stay F32): what ``llama-quantize source target TYPE`` does, for the non-K types."""
    if qtype not in PYTHON_QUANT_TYPES:
        raise ValueError(
            f"{qtype.name} needs llama-quantize (--llamacpp-bin); without it: "
            f"{', '.join(t.name for t in PYTHON_QUANT_TYPES)}"
        )
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for t in reader.tensors:
        if t.tensor_type == Q.F32 or len(t.shape) < 2:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        else:
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            writer.add_tensor(t.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
