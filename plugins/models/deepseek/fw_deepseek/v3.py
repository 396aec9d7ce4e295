"""DeepSeek-V3 / R1 and GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): DeepSeek-V2's multi-head
latent attention (:mod:`fw_deepseek.model`) with DeepSeek-V3's MoE
(:class:`framework.layers.grouped_moe.GroupedTopkMoE`: sigmoid router, score-correction bias
used only to choose, group-limited top-k, ``routed_scaling_factor``, shared experts).

| part | DeepSeek-V3 / R1 | GLM-4.7-Flash |
| --- | --- | --- |
| attention | MLA with ``q_lora_rank``; rotary on interleaved pairs unless ``rope_interleave`` is false | same |
| MoE layers | from ``first_k_dense_replace`` on | where ``mlp_layer_types`` says ``"sparse"`` (default: all but the first) |
| router | ``n_group`` groups, ``topk_group`` kept (8 / 4) | one group |

Checkpoints append the multi-token-prediction layer(s) after the decoder
(``model.layers.{num_hidden_layers}.*``); plain decoding does not run them and loading skips
them. Tensor parallelism is DeepSeek-V2's (heads and experts split, the latent replicated).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from framework.config import ModelConfig
from framework.layers.causal_lm import drop_extra_layers
from framework.layers.grouped_moe import GroupedTopkMoE
from framework.layers.mlp import dense_mlp
from framework.loader.model_loader import load_parameters
from framework.quantization import QuantConfig
from fw_deepseek.model import DeepseekV2ForCausalLM, is_moe_layer


def deepseek_v3_mlp(config: ModelConfig, layer_index: int, quant_config: QuantConfig | None, prefix: str) -> nn.Module:
    """DeepSeek-V3's MoE on MoE layers (:func:`fw_deepseek.model.is_moe_layer`), else a dense SwiGLU."""
    if is_moe_layer(config, layer_index):
        return GroupedTopkMoE(config, quant_config, prefix)
    return dense_mlp(config, layer_index, quant_config, prefix)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 (and GLM-4.7-Flash): ``forward(input_ids, positions) -> hidden``; ``compute_logits``."""

    make_mlp = staticmethod(deepseek_v3_mlp)
    #: loading only filters names; the layers' loaders take the lazy slices as they come
    reads_checkpoint_slices = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tensors without its multi-token-prediction layers."""
        return load_parameters(self, drop_extra_layers(weights, self.config.num_layers))


def glm4_moe_lite_mlp(
    config: ModelConfig, layer_index: int, quant_config: QuantConfig | None, prefix: str
) -> nn.Module:
    """DeepSeek-V3's MoE where ``mlp_layer_types`` says ``"sparse"``; transformers' default when the
    config has none: the first layer dense, the others MoE (``first_k_dense_replace`` is not read)."""
    layer_types = config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (config.num_layers - 1)
    if layer_types[layer_index] == "sparse":
        return GroupedTopkMoE(config, quant_config, prefix)
    return dense_mlp(config, layer_index, quant_config, prefix)


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's layers; its config lists which layers are MoE (``mlp_layer_types``)."""

    make_mlp = staticmethod(glm4_moe_lite_mlp)
