"""GGUF files of gpt-oss (`gpt-oss`: gpt-oss-20b / -120b), as llama.cpp's converter writes them,
served by fw_llama's ``GptOssForCausalLM`` with the experts still MXFP4.

Metadata -> Hugging Face config (llama.cpp keys, `gpt-oss.` prefixed):

| GGUF (`gpt-oss.`) | HF | note |
| --- | --- | --- |
| `expert_feed_forward_length` | `intermediate_size` | each expert's width |
| `expert_count` / `expert_used_count` | `num_local_experts` / `num_experts_per_tok` | |
| `attention.sliding_window` | `sliding_window`, `layer_types` | llama.cpp: window on even layers (pattern 2) |
| `rope.scaling.*` (yarn) | `rope_scaling` with `truncate: false` | gpt-oss's YaRN keeps the correction range unrounded |

llama.cpp hard-codes the clamped SwiGLU of the experts (limit 7, alpha 1.702); they are given back
explicitly. Tensors the converter renames: ``attn_sinks.weight`` (HF ``self_attn.sinks``),
``post_attention_norm`` (``post_attention_layernorm``), ``ffn_gate_inp`` (``mlp.router``, with its
bias). The experts' interleaved ``gate_up_proj`` (rows and bias: gate 0, up 0, gate 1, ...) is
split into ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` (biases ``[E, I]``), and
``down_proj`` becomes ``ffn_down_exps`` ``[E, H, I]``: per-projection stacks, which FusedMoE's
loader takes as its ``w1`` / ``w3`` / ``w2`` shards, so nothing needs re-interleaving.

The MXFP4 stacks hold the checkpoint's values and scales, only re-laid out: per block of 32 a
ggml block ``| e 1 | qs 16 |`` where ``qs[i]`` holds value ``i`` (low nibble) and ``16 + i``
(high), against the checkpoint's ``blocks [.., 16]`` (byte ``j``: values ``2j``, ``2j + 1``) and
``scales [..]``. The e2m1 codes and the e8m0 byte mean the same in both (ggml's doubled values
times half the scale), so :func:`to_checkpoint_mxfp4` moves nibbles and nothing else, and the
layer runs fw_fp4's MXFP4 MoE method (its Triton grouped GEMM on CUDA), exactly as the checkpoint
would. A layer whose stacks are not all MXFP4 (re-quantized files) takes FusedMoE's plain weights,
dequantized at load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from framework.errors import ConfigError

#: GGUF architectures served here -> HF (model_type, architectures[0]).
GPT_OSS_ARCHITECTURES = {"gpt-oss": ("gpt_oss", "GptOssForCausalLM")}

#: What llama.cpp hard-codes for gpt-oss's experts (``ggml_swiglu_oai``).
SWIGLU_LIMIT = 7.0
SWIGLU_ALPHA = 1.702
#: ggml's MXFP4 block: one e8m0 byte, then 16 bytes of e2m1 codes.
MXFP4_BLOCK_BYTES = 17
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}


def gpt_oss_config(key: Callable[..., Any], config: dict[str, Any], names: set[str] | None) -> dict[str, Any]:
    """The config keys of a `gpt-oss` file beyond the shared ones in `config` (the table above);
    `key(name, default)` reads `gpt-oss.name`."""
    num_layers = config["num_hidden_layers"]
    pattern = key("attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        is_sliding = [bool(x) for x in pattern]
    else:  # llama.cpp: layer il slides when il % n < n - 1
        is_sliding = [i % pattern < pattern - 1 for i in range(num_layers)]
    scaling = config.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type") == "yarn":
        scaling = {**scaling, "truncate": False}
    return {
        "intermediate_size": key("expert_feed_forward_length", config["intermediate_size"]),
        "num_local_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in is_sliding],
        "rope_scaling": scaling,
        "swiglu_limit": SWIGLU_LIMIT,
        "swiglu_alpha": SWIGLU_ALPHA,
        "attention_bias": True if names is None else "blk.0.attn_q.bias" in names,
    }


def gpt_oss_tensors() -> dict[str, str]:
    """Per-layer GGUF tensor name -> HF name (without `blk.{i}.` / `model.layers.{i}.` and the
    suffix), beyond the shared attention names."""
    return dict(_TENSORS)


def gpt_oss_names(num_layers: int) -> dict[str, str]:
    """The sinks: the converter gave them a `.weight` suffix HF's name does not have."""
    return {f"blk.{i}.attn_sinks.weight": f"model.layers.{i}.self_attn.sinks" for i in range(num_layers)}


def experts_are_mxfp4(tensor_types: dict[str, str], prefix: str) -> bool:
    """Whether the FusedMoE at ``prefix`` (``model.layers.{i}.mlp.experts``) has all three stacks in MXFP4."""
    return all(tensor_types.get(f"{prefix}.{projection}.weight") == "MXFP4" for projection in _PROJECTIONS)


def mxfp4_moe_method(tensor_types: dict[str, str], prefix: str):
    """fw_fp4's ``Mxfp4FusedMoEMethod`` for a gpt-oss expert layer whose stacks are MXFP4, else None
    (plain weights, dequantized at load). Raises ConfigError when fw-fp4 is not installed."""
    if not experts_are_mxfp4(tensor_types, prefix):
        return None
    try:
        from fw_fp4.moe import Mxfp4FusedMoEMethod
    except ImportError as exc:
        raise ConfigError(
            f"{prefix}: this gpt-oss GGUF's experts are MXFP4, which run on the fp4 plugin's MXFP4 MoE method; "
            f"install fw-fp4 (pip install -e plugins/quant/fp4) ({exc})"
        ) from None
    return Mxfp4FusedMoEMethod()


def to_checkpoint_mxfp4(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 rows uint8 ``[..., K/32 * 17]`` -> gpt-oss checkpoint ``(blocks uint8 [..., K/32, 16],
    scales uint8 [..., K/32])``, the same codes and scale bytes re-laid out (module docstring)::

        ggml  qs[i] = code[i] | code[16 + i] << 4         checkpoint  blocks[j] = code[2j] | code[2j + 1] << 4
    """
    if data.dtype != torch.uint8 or data.shape[-1] % MXFP4_BLOCK_BYTES:
        raise ValueError(
            f"MXFP4 rows must be uint8 of whole {MXFP4_BLOCK_BYTES}-byte blocks, got {data.dtype} {tuple(data.shape)}"
        )
    blocks = data.unflatten(-1, (-1, MXFP4_BLOCK_BYTES))
    qs = blocks[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [..., K/32, 32], values in order
    return codes[..., 0::2] | (codes[..., 1::2] << 4), blocks[..., 0].contiguous()


def mxfp4_expert_tensors(hf_name: str, data: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``...experts.<proj>.weight`` packed MXFP4 ``[E, rows, bytes]`` -> ``...experts.<proj>.blocks``
    and ``.scales`` in the checkpoint layout (FusedMoE puts them in ``w13_blocks`` / ``w2_scales``...)."""
    blocks, scales = to_checkpoint_mxfp4(data)
    base = hf_name.removesuffix(".weight")
    yield f"{base}.blocks", blocks.contiguous()
    yield f"{base}.scales", scales
