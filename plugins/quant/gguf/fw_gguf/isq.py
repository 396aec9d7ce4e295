"""``--isq q4_0 .. q6k``: which GGUF type each weight matrix of a 16-bit checkpoint gets.

The recipe follows llama.cpp (``llama_tensor_get_type`` in src/llama-quant.cpp):

* every type: the output head (the token embedding where the head is tied) is Q6_K (Q8_0 for
  q8_0, and for a head whose width is not a multiple of 256), as llama.cpp does for every file type;
* q4k is **Q4_K_M**: ``v_proj`` and ``down_proj`` of the first and last eighth of the layers and
  of every third layer in between (``use_more_bits``) are Q6_K, the rest Q4_K; the other names put
  every other matrix in their one type (llama.cpp's Q2_K / Q3_K_* / Q5_K_* files mix more types);
* a K-quant matrix whose input width is not a multiple of 256 falls back as llama.cpp does
  (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; Q2_K / Q3_K -> Q4_0 where llama.cpp takes IQ4_NL,
  a type fw does not quantize), and a width that is no multiple of 32 stays in 16 bits.

Norms, biases, MoE routers and MoE experts stay as they are (fw's GGUF experts come from stacked
tensors a 16-bit checkpoint does not have).
"""

from __future__ import annotations

import re
from typing import Any

from gguf import GGMLQuantizationType as Q

ISQ_TYPES: dict[str, Q] = {
    "q4_0": Q.Q4_0,
    "q4_1": Q.Q4_1,
    "q5_0": Q.Q5_0,
    "q5_1": Q.Q5_1,
    "q8_0": Q.Q8_0,
    "q2k": Q.Q2_K,
    "q3k": Q.Q3_K,
    "q4k": Q.Q4_K,
    "q5k": Q.Q5_K,
    "q6k": Q.Q6_K,
}
_K_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
_K_TYPES = frozenset(_K_FALLBACK)
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_ROUTERS = ("mlp.gate.weight", "shared_expert_gate.weight")


def use_more_bits(index: int, count: int) -> bool:
    """llama.cpp's choice of the layers Q4_K_M gives 6 bits: the first and last eighth, and every third one between."""
    return index < count // 8 or index >= 7 * count // 8 or (index - count // 8) % 3 == 2


def is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """The checkpoint tensors GGUF ISQ quantizes: 2-D weight matrices other than norms, routers and experts."""
    return (
        len(shape) == 2
        and name.endswith(".weight")
        and "norm" not in name
        and ".experts." not in name
        and not name.endswith(_ROUTERS)
    )


def _fits(qtype: Q, width: int) -> Q | None:
    """``qtype``, or llama.cpp's fallback when rows of ``width`` values are no whole number of its blocks."""
    if qtype in _K_TYPES and width % 256:
        qtype = _K_FALLBACK[qtype]
    return qtype if width % 32 == 0 else None


def tensor_types(
    isq_type: str, weight_shapes: dict[str, tuple[int, ...]], num_layers: int, tie_word_embeddings: bool
) -> dict[str, str]:
    """HF tensor name -> GGUF type name for every matrix ``--isq isq_type`` quantizes."""
    base = ISQ_TYPES[isq_type]
    head = (
        "lm_head.weight"
        if "lm_head.weight" in weight_shapes and not tie_word_embeddings
        else "model.embed_tokens.weight"
    )
    types: dict[str, str] = {}
    for name, shape in weight_shapes.items():
        if not is_quantizable(name, shape):
            continue
        width = shape[1]
        qtype = base
        if name == head:
            qtype = Q.Q8_0 if base == Q.Q8_0 or width % 256 else Q.Q6_K
        elif isq_type == "q4k" and name.endswith(("v_proj.weight", "down_proj.weight")):
            layer = _LAYER.search(name)
            if layer is not None and use_more_bits(int(layer.group(1)), num_layers):
                qtype = Q.Q6_K
        chosen = _fits(qtype, width)
        if chosen is not None:
            types[name] = chosen.name
    return types


def isq_quant_config(isq_type: str, model_config: Any, weight_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The ``quantization_config`` a GGUF file quantized this way would report (``tensor_types``)."""
    if isq_type not in ISQ_TYPES:
        raise ValueError(f"fw_gguf offers --isq {', '.join(ISQ_TYPES)}; got {isq_type!r}")
    tied = bool(model_config.get("tie_word_embeddings", False))
    types = tensor_types(isq_type, weight_shapes, int(model_config.get("num_hidden_layers")), tied)
    return {"quant_method": "gguf", "tensor_types": types}
