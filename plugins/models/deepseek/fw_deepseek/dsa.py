"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-5 (``GlmMoeDsaForCausalLM``): DeepSeek-V3's
MLA and MoE (:mod:`fw_deepseek.v3`) with DeepSeek Sparse Attention: a lightning indexer
(:mod:`fw_deepseek.indexer`) picks each query's ``index_topk`` tokens, and MLA attends only to them.

| part | DeepSeek-V3.2 | GLM-5 |
| --- | --- | --- |
| indexer rotary | on halves of the first ``qk_rope_head_dim`` features | on interleaved pairs |
| indexer per layer | every layer | ``indexer_types``: ``"full"`` runs one, ``"shared"`` reuses the last full layer's choice |
| MoE layers | ``mlp_layer_types`` (default: dense for the first ``first_k_dense_replace``) | same |

MLA always has a ``q_lora_rank`` here (the indexer's query reads ``q_a_layernorm(q_a_proj(x))``)
and rotates interleaved pairs. A layer with an indexer caches ``kv_lora_rank + qk_rope_head_dim +
index_head_dim`` numbers per token (the latent, then the indexer key); a shared layer only the
latent. Only attention backends with ``supports_sparse_mla`` run these layers (the torch
reference today); the engine names the reason when it refuses the others. The MTP layer is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from framework.config import ModelConfig
from framework.errors import ConfigError
from framework.layers.grouped_moe import GroupedTopkMoE
from framework.layers.mlp import dense_mlp
from framework.quantization import QuantConfig
from fw_deepseek.indexer import LightningIndexer
from fw_deepseek.model import AttentionFactory, DeepseekV2Attention
from fw_deepseek.v3 import DeepseekV3ForCausalLM

INDEXER_TYPES = ("full", "shared")


@dataclass(slots=True)
class SharedSelection:
    """The tokens the last ``"full"`` layer of this forward pass chose (GLM-5's shared layers read them)."""

    topk_indices: torch.Tensor | None = None


def indexer_types(config: ModelConfig) -> list[str]:
    """Per layer ``"full"`` or ``"shared"``: the config's ``indexer_types``, else transformers'
    derivation from ``index_topk_pattern`` (``"FSS..."``) or ``index_topk_freq`` /
    ``index_skip_topk_offset`` (DeepSeek-V3.2 configs have none of these: every layer is full)."""
    types = config.get("indexer_types")
    if types is None and (pattern := config.get("index_topk_pattern")) is not None:
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        freq, offset = max(int(config.get("index_topk_freq") or 1), 1), int(config.get("index_skip_topk_offset") or 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(config.num_layers)]
    types = list(types)
    if len(types) != config.num_layers or any(t not in INDEXER_TYPES for t in types):
        raise ConfigError(f"indexer_types {types!r}: expected {config.num_layers} of {', '.join(INDEXER_TYPES)}")
    if types[0] != "full":
        raise ConfigError("indexer_types: the first layer must be 'full' (a shared layer reuses an earlier choice)")
    return types


class SparseMLAAttention(DeepseekV2Attention):
    """DeepSeek-V2's absorbed MLA attending only to the tokens its indexer chose (or, for a GLM-5
    ``"shared"`` layer, the tokens the last full layer chose)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        quant_config: QuantConfig | None,
        prefix: str,
        *,
        selection: SharedSelection,
        indexer_rope_is_neox: bool,
    ) -> None:
        if not config.get("q_lora_rank"):
            raise ConfigError(f"{config.architecture} needs q_lora_rank: the indexer's query reads MLA's q_a_proj")
        is_full = indexer_types(config)[layer_index] == "full"
        index_head_dim = int(config.get("index_head_dim")) if is_full else 0
        super().__init__(config, layer_index, quant_config, prefix, is_sparse=True, index_head_dim=index_head_dim)
        self.selection = selection
        self.indexer = None
        if is_full:
            self.indexer = LightningIndexer(
                config, layer_index, quant_config, f"{prefix}.indexer", is_neox_style=indexer_rope_is_neox
            )

    def select_tokens(
        self, positions: torch.Tensor, hidden: torch.Tensor, q_resid: torch.Tensor | None
    ) -> torch.Tensor:
        if self.indexer is not None:
            self.selection.topk_indices = self.indexer(positions, hidden, q_resid)
        return self.selection.topk_indices


def dsa_mlp(config: ModelConfig, layer_index: int, quant_config: QuantConfig | None, prefix: str):
    """DeepSeek-V3's MoE where ``mlp_layer_types`` says ``"sparse"``; without it the first
    ``first_k_dense_replace`` (default 3) layers are dense, as transformers' config derives."""
    layer_types = config.get("mlp_layer_types")
    if layer_types is None:
        num_dense = min(int(config.get("first_k_dense_replace", 3)), config.num_layers)
        layer_types = ["dense"] * num_dense + ["sparse"] * (config.num_layers - num_dense)
    if layer_types[layer_index] == "sparse":
        return GroupedTopkMoE(config, quant_config, prefix)
    return dense_mlp(config, layer_index, quant_config, prefix)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: ``forward(input_ids, positions) -> hidden``; ``compute_logits``."""

    make_mlp = staticmethod(dsa_mlp)
    #: DeepSeek-V3.2's indexer rotates halves; GLM-5's interleaved pairs
    indexer_rope_is_neox = True

    def attention_factory(self, config: ModelConfig) -> AttentionFactory:
        indexer_types(config)  # a bad schedule fails before any layer is built
        return partial(SparseMLAAttention, selection=SharedSelection(), indexer_rope_is_neox=self.indexer_rope_is_neox)


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5: DeepSeek-V3.2's layers, the indexer on interleaved pairs, shared layers per ``indexer_types``."""

    indexer_rope_is_neox = False
