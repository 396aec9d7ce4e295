"""GGUF files of the hybrid Gated DeltaNet models: `qwen35` (Qwen3.5 dense), `qwen35moe` (Qwen3.5-MoE)
and `qwen3next` (Qwen3-Next), as llama.cpp's converter writes them, served by the `qwen3_next` plugin.

Metadata -> Hugging Face config (llama.cpp keys, `{arch}.` prefixed):

| GGUF (`{arch}.`) | HF | note |
| --- | --- | --- |
| `ssm.conv_kernel` / `ssm.state_size` | `linear_conv_kernel_dim` / `linear_key_head_dim` | |
| `ssm.group_count` / `ssm.time_step_rank` | `linear_num_key_heads` / `linear_num_value_heads` | |
| `ssm.inner_size` | `linear_value_head_dim * linear_num_value_heads` | |
| `attention.recurrent_layers`, else `full_attention_interval` | `layer_types` | llama.cpp's default interval: 4 |
| `rope.dimension_count` | `partial_rotary_factor * head_dim` | (M)RoPE of text: plain NeoX rotary |
| `nextn_predict_layers` | MTP blocks counted in `block_count`: not built, tensors skipped | |
| `expert_*`, `expert_shared_feed_forward_length` | the Qwen-MoE keys | MoE archs: every layer sparse |

What the converter changes and :func:`to_hf_layout` undoes:

- every RMSNorm weight but the DeltaNet output norm (`ssm_norm`) is stored ``1 + w``: the models'
  norms are zero-centred (``x * (1 + w)``), llama.cpp's are not (:func:`norm_weight_offset`);
- ``A_log`` is stored as ``ssm_a = -exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, the conv weight
  ``[channels, 1, K]`` squeezed to ``[channels, K]``;
- Qwen3.5 (not Qwen3-Next) with fewer key than value heads: the value heads are stored *tiled*
  (``v0 of every key head, then v1 ...``) instead of grouped by key head, in the v rows of
  ``attn_qkv`` and the conv, the rows of ``attn_gate``, ``ssm_alpha``, ``ssm_beta``, ``ssm_a``,
  ``ssm_dt``, and the columns of ``ssm_out``. Rows are regrouped as whole (packed) rows; ``ssm_out``
  stays as stored, its layer gathering its input into the tiled order instead
  (:meth:`HybridLayout.input_orders`: the ``gguf`` method's ``input_orders``), as a head narrower
  than a block (128 features in Q4_K's 256) would split blocks;
- Qwen3-Next's ``in_proj_qkvz`` (per key head ``q, k, v, z``) is stored split, as ``attn_qkv``
  (all q, all k, all v) and ``attn_gate`` (z): :func:`fuse_qkvz` puts the rows back (packed when
  both tensors have one GGUF type, else as floats); ``in_proj_ba`` stays whole, as ``ssm_ba``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: GGUF architectures served here -> HF (model_type, architectures[0]).
HYBRID_ARCHITECTURES = {
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
    "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
}
HYBRID_MOE = ("qwen35moe", "qwen3next")
#: the archs whose converter regroups the value heads into tiled order
_TILED_V = ("qwen35", "qwen35moe")

_GDN_TENSORS = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "post_attention_norm": "post_attention_layernorm",
}


def hybrid_config(arch: str, key: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    """The config keys of a hybrid file beyond the shared ones in `config` (the table above);
    `key(name, default)` reads `{arch}.name`."""
    num_layers = config["num_hidden_layers"] - key("nextn_predict_layers", 0)
    recurrent = key("attention.recurrent_layers", None)
    if recurrent is None:
        interval = key("full_attention_interval", 4)
        recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]
    num_v_heads = key("ssm.time_step_rank")
    head_dim = config["head_dim"]
    update: dict[str, Any] = {
        "num_hidden_layers": num_layers,
        "layer_types": ["linear_attention" if r else "full_attention" for r in list(recurrent)[:num_layers]],
        "linear_conv_kernel_dim": key("ssm.conv_kernel"),
        "linear_key_head_dim": key("ssm.state_size"),
        "linear_num_key_heads": key("ssm.group_count"),
        "linear_num_value_heads": num_v_heads,
        "linear_value_head_dim": key("ssm.inner_size") // num_v_heads,
        "partial_rotary_factor": key("rope.dimension_count", head_dim) / head_dim,
    }
    if arch in HYBRID_MOE:
        update.update(
            {
                "num_experts": key("expert_count"),
                "num_experts_per_tok": key("expert_used_count"),
                "moe_intermediate_size": key("expert_feed_forward_length"),
                "shared_expert_intermediate_size": key("expert_shared_feed_forward_length"),
                "norm_topk_prob": bool(key("expert_weights_norm", True)),
                "decoder_sparse_step": 1,
            }
        )
    return update


def hybrid_tensors(arch: str) -> dict[str, str]:
    """Per-layer GGUF tensor name -> HF name (without `blk.{i}.` / `model.layers.{i}.` and the suffix);
    Qwen3-Next's `attn_qkv` is the fused `in_proj_qkvz` (its `attn_gate` joins it: :func:`fuse_qkvz`)."""
    if arch == "qwen3next":
        return {**_GDN_TENSORS, "attn_qkv": "linear_attn.in_proj_qkvz"}
    return dict(_GDN_TENSORS)


def hybrid_layer_names(num_layers: int) -> dict[str, str]:
    """The DeltaNet vectors whose GGUF names have no `.weight` suffix or a different one than HF's."""
    names = {}
    for i in range(num_layers):
        names[f"blk.{i}.ssm_a"] = f"model.layers.{i}.linear_attn.A_log"
        names[f"blk.{i}.ssm_dt.bias"] = f"model.layers.{i}.linear_attn.dt_bias"
    return names


def tile_index(num_k_heads: int, num_v_heads: int, width: int, device: torch.device | None = None) -> torch.Tensor:
    """The converter's value-head tiling as a gather: ``tiled = grouped[index]`` (the inverse of
    :func:`untile_index`)."""
    per_key = num_v_heads // num_k_heads
    rows = torch.arange(num_v_heads * width, device=device)
    return rows.reshape(num_k_heads, per_key, width).transpose(0, 1).reshape(-1)


def untile_index(num_k_heads: int, num_v_heads: int, width: int, device: torch.device | None = None) -> torch.Tensor:
    """Row order that undoes the converter's value-head tiling: `grouped = tiled[index]`.

    ``width`` rows per head; llama.cpp stores head ``(key head kh, j-th value head of kh)`` at
    tiled position ``j * Hk + kh``, the model wants it at ``kh * (Hv / Hk) + j``::

        tiled:   [k0v0 k1v0 | k0v1 k1v1]   ->   grouped: [k0v0 k0v1 | k1v0 k1v1]
    """
    per_key = num_v_heads // num_k_heads
    rows = torch.arange(num_v_heads * width, device=device)
    return rows.reshape(per_key, num_k_heads, width).transpose(0, 1).reshape(-1)


class HybridLayout:
    """The head counts :func:`to_hf_layout` needs, from the file's HF config."""

    def __init__(self, arch: str, config: dict[str, Any]) -> None:
        self.num_k, self.num_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
        self.dk, self.dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
        self.tiled = arch in _TILED_V and self.num_k != self.num_v

    def untile_rows(self, tensor: torch.Tensor, width: int, skip: int = 0) -> torch.Tensor:
        """``tensor`` with its rows ``skip:`` (value heads of ``width`` rows) regrouped; whole rows,
        so packed GGUF rows too."""
        if not self.tiled:
            return tensor
        index = untile_index(self.num_k, self.num_v, width, tensor.device)
        return torch.cat([tensor[:skip], tensor[skip:].index_select(0, index)])

    def input_orders(self, hf_names: list[str]) -> dict[str, list[int]]:
        """``{out_proj weight name: [Hk, Hv, Dv]}`` for the layers that keep llama.cpp's tiled input
        columns (the ``gguf`` method's ``input_orders``: it gathers ``x[:, tile_index(Hk, Hv, Dv)]``)."""
        if not self.tiled:
            return {}
        order = [self.num_k, self.num_v, self.dv]
        return {name: order for name in hf_names if name.endswith(".linear_attn.out_proj.weight")}


def fuse_qkvz(layout: HybridLayout, qkv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next's ``in_proj_qkvz`` rows from llama.cpp's ``attn_qkv`` and ``attn_gate`` (whole
    rows: packed ones too, when both share a GGUF type)::

        attn_qkv: [q0 q1 | k0 k1 | v0 v1]   attn_gate: [z0 z1]   ->   [q0 k0 v0 z0 | q1 k1 v1 z1]

    (``vh`` / ``zh``: the ``Hv / Hk`` value heads of key head ``h``)."""
    dk, group = layout.dk, layout.num_v // layout.num_k * layout.dv
    key_dim, value_dim = layout.num_k * dk, layout.num_k * group
    heads = torch.arange(layout.num_k, device=qkv.device)[:, None]
    parts = [
        heads * dk + torch.arange(dk, device=qkv.device),
        key_dim + heads * dk + torch.arange(dk, device=qkv.device),
        2 * key_dim + heads * group + torch.arange(group, device=qkv.device),
        2 * key_dim + value_dim + heads * group + torch.arange(group, device=qkv.device),
    ]
    return torch.cat([qkv, gate]).index_select(0, torch.cat(parts, dim=1).reshape(-1))


def to_hf_layout(layout: HybridLayout, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A DeltaNet tensor in the HF checkpoint's layout (the converter's changes undone; norms'
    ``+1`` excepted: :func:`norm_weight_offset`; ``out_proj``'s columns stay tiled:
    :meth:`HybridLayout.input_orders`). Other tensors come back unchanged."""
    if ".linear_attn." not in hf_name:
        return tensor
    key_dim = layout.num_k * layout.dk
    leaf = hf_name.rsplit(".linear_attn.", 1)[1]
    if leaf == "A_log":
        return layout.untile_rows(torch.log(-tensor), 1)
    if leaf == "dt_bias":
        return layout.untile_rows(tensor, 1)
    if leaf == "conv1d.weight":
        return layout.untile_rows(tensor, layout.dv, skip=2 * key_dim).unsqueeze(1)
    if leaf == "in_proj_qkv.weight":
        return layout.untile_rows(tensor, layout.dv, skip=2 * key_dim)
    if leaf == "in_proj_z.weight":
        return layout.untile_rows(tensor, layout.dv)
    if leaf in ("in_proj_a.weight", "in_proj_b.weight"):
        return layout.untile_rows(tensor, 1)
    return tensor


def norm_is_shifted(hf_name: str) -> bool:
    """Whether a model whose converter shifts norms stored this tensor as ``1 + w``: every norm
    weight but the DeltaNet output norm (for Gemma, which has none, every norm weight)."""
    return hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight")
