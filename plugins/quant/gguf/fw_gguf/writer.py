"""Write an ISQ-quantized model as a GGUF file llama.cpp loads (``fw quantize --isq q4k SRC out.gguf``).

The file holds what llama.cpp's ``convert_hf_to_gguf.py`` + ``llama-quantize`` would write for a
``llama`` architecture model (Llama, Mistral, SmolLM): the ``llama.*`` hyper-parameters, the
tokenizer as ``tokenizer.ggml.*`` (a byte-level BPE ``tokenizer.json`` becomes the ``gpt2`` model
with its tokens, token types and merges, and the llama.cpp pre-tokenizer name of its split), the chat template, and the tensors under llama.cpp's
names with q/k rows in llama.cpp's rotary order (:func:`permute_qk`, undone by
:func:`fw_gguf.config.unpermute_qk` when fw reads the file back). Norms stay float32, as
llama.cpp keeps them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf
import torch
from gguf import GGMLQuantizationType as Q

from framework.errors import ConfigError

from .config import qk_unpermute_index, tensor_name_map

#: llama.cpp's ``llama_ftype`` of each ``--isq`` name (``general.file_type``).
FILE_TYPES = {
    "q4_0": 2,
    "q4_1": 3,
    "q8_0": 7,
    "q5_0": 8,
    "q5_1": 9,
    "q2k": 10,
    "q3k": 11,
    "q4k": 15,
    "q5k": 16,
    "q6k": 18,
}
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER = 1, 3, 4


def permute_qk(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF's q/k row order -> llama.cpp's (the inverse of ``unpermute_qk``); whole rows, so packed rows too."""
    index = qk_unpermute_index(rows.shape[0], num_heads, rows.device)
    return rows.index_select(0, torch.argsort(index))


def llama_metadata(writer: gguf.GGUFWriter, hf: dict[str, Any], name: str, isq_type: str) -> None:
    """The ``llama.*`` keys llama.cpp (and fw's reader) need, from a ``config.json``."""
    if hf.get("model_type") not in ("llama", "mistral"):
        raise ConfigError(
            f"writing GGUF files supports llama-architecture models (Llama, Mistral, SmolLM); "
            f"this one is {hf.get('model_type')!r}"
        )
    scaling = hf.get("rope_scaling") or {}
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default", "linear"):
        raise ConfigError(
            f"rope_scaling {scaling.get('rope_type', scaling.get('type'))!r} is not written to GGUF "
            "yet; supported: none, linear"
        )
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    writer.add_name(name)
    writer.add_context_length(hf.get("max_position_embeddings", 4096))
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(hf.get("num_key_value_heads", heads))
    writer.add_layer_norm_rms_eps(hf.get("rms_norm_eps", 1e-5))
    writer.add_rope_freq_base(hf.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(hf["vocab_size"])
    if scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    writer.add_file_type(FILE_TYPES[isq_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def llama_cpp_pre_tokenizer(pre_tokenizer: dict[str, Any] | None) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` name for a ``tokenizer.json`` byte-level pre-tokenizer: its
    split regex (:data:`fw_gguf.tokenizer.PRE_TOKENIZER_SPLITS`, Llama 3's or Qwen 2's), SmolLM's
    per-digit split before GPT-2's, or GPT-2's own (a bare ``ByteLevel``). llama.cpp refuses a name it
    does not know, so anything else is an error naming the kinds written."""
    from .tokenizer import _LLAMA3_SPLIT, _QWEN2_SPLIT

    steps = (pre_tokenizer or {}).get("pretokenizers", [pre_tokenizer] if pre_tokenizer else [])
    kinds = [step.get("type") for step in steps]
    splits = [step.get("pattern", {}).get("Regex") for step in steps if step.get("type") == "Split"]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds[:1] == ["Split"] and kinds[-1:] == ["ByteLevel"] and len(splits) == 1:
        named = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}.get(splits[0])
        if named:
            return named
    raise ConfigError(
        f"writing GGUF files: no llama.cpp pre-tokenizer matches this tokenizer's ({' + '.join(map(str, kinds))}); "
        "written: GPT-2's byte-level regex, SmolLM's digits split, Llama 3's and Qwen 2's split regexes"
    )


def tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer: Any, generation: dict[str, Any]) -> None:
    """``tokenizer.ggml.*`` of a byte-level BPE tokenizer (``fw.tokenizer.Tokenizer``)."""
    spec = json.loads(tokenizer.backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise ConfigError(
            "writing GGUF files supports byte-level BPE tokenizers (GPT-2 style tokenizer.json); "
            f"this tokenizer is {model.get('type')!r}"
        )
    added = {token["id"]: token for token in spec.get("added_tokens", [])}
    vocab = dict(model["vocab"])
    for token in added.values():
        vocab.setdefault(token["content"], token["id"])
    size = max(vocab.values()) + 1
    tokens, types = [f"[PAD{i}]" for i in range(size)], [_TOKEN_USER] * size
    for text, index in vocab.items():
        tokens[index] = text
        types[index] = _TOKEN_NORMAL
    for index, token in added.items():
        types[index] = _TOKEN_CONTROL if token.get("special") else _TOKEN_USER
    merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(llama_cpp_pre_tokenizer(spec.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = {text: index for index, text in enumerate(tokens)}
    for key, text in (("bos", tokenizer.bos_token), ("eos", tokenizer.eos_token), ("pad", tokenizer.pad_token)):
        if text in ids:
            getattr(writer, f"add_{key}_token_id")(ids[text])
    eos = generation.get("eos_token_id")
    if tokenizer.eos_token not in ids and isinstance(eos, int):
        writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def write_gguf(
    dst: Path, source: Any, weights: Iterable[tuple[str, torch.Tensor]], tensor_types: dict[str, str], isq_type: str
) -> Path:
    """Write ``weights`` (ISQ's stream: packed rows for the names in ``tensor_types``, floats for the
    rest) of ``source`` (its config and tokenizer) to the GGUF file ``dst``."""
    if dst.suffix != ".gguf":
        raise ConfigError(f"{dst}: a GGUF output file name ends in .gguf")
    hf = source.hf_config()
    names = tensor_name_map("llama", int(hf["num_hidden_layers"]))
    to_gguf = {hf_name: gguf_name for gguf_name, hf_name in names.items()}
    heads = {
        "self_attn.q_proj": hf["num_attention_heads"],
        "self_attn.k_proj": hf.get("num_key_value_heads", hf["num_attention_heads"]),
    }
    writer = gguf.GGUFWriter(str(dst), "llama")
    llama_metadata(writer, hf, Path(str(getattr(source, "path", dst.stem))).name, isq_type)
    tokenizer_metadata(writer, source.tokenizer(), source.generation_config())
    tied = bool(hf.get("tie_word_embeddings", False))
    for name, tensor in weights:
        if name == "lm_head.weight" and tied:
            continue  # llama.cpp reads a tied head from token_embd
        if name not in to_gguf:
            raise ConfigError(f"{name}: no llama.cpp tensor of the llama architecture holds it")
        rows = next((n for leaf, n in heads.items() if f".{leaf}." in name), None)
        if rows is not None:
            tensor = permute_qk(tensor, rows)
        qtype = tensor_types.get(name)
        if qtype is None:
            writer.add_tensor(to_gguf[name], tensor.float().cpu().numpy(), raw_dtype=Q.F32)
        else:
            writer.add_tensor(to_gguf[name], tensor.cpu().numpy(), raw_dtype=Q[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    return dst
