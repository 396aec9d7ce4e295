"""GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``): a Llama decoder with DeepSeek-V3's MoE.

What differs from the Llama family (``model.py``), switched on by the architecture name:

| part | GLM-4.5 MoE |
| --- | --- |
| attention | GQA; q/k/v bias per ``attention_bias``, none on o_proj; Qwen3's RMS QK norm when ``use_qk_norm`` |
| rotary | NeoX halves of the first ``partial_rotary_factor`` (0.5) of each head |
| feed-forward | dense SwiGLU below ``first_k_dense_replace``, then :class:`~framework.layers.grouped_moe.GroupedTopkMoE` |
| checkpoint | the MTP layer(s) after the decoder (``model.layers.{num_hidden_layers}.*``) are skipped |

Tensor parallelism is the Llama family's (heads and every expert's features split, the routers
replicated, the MoE block's all-reduce deferred to the next norm).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from framework.config import ModelConfig
from framework.layers.causal_lm import CausalLM, drop_extra_layers
from framework.layers.fused_moe import map_expert_weight_name
from framework.layers.grouped_moe import GroupedTopkMoE
from framework.layers.mlp import dense_mlp
from framework.loader.model_loader import load_parameters
from framework.quantization import QuantConfig

from .model import LlamaModel


def glm4_moe_mlp(config: ModelConfig, layer_index: int, quant_config: QuantConfig | None, prefix: str) -> nn.Module:
    """MoE from ``first_k_dense_replace`` on (when the config has routed experts), else a dense SwiGLU."""
    if config.get("n_routed_experts") and layer_index >= int(config.get("first_k_dense_replace") or 0):
        return GroupedTopkMoE(config, quant_config, prefix)
    return dense_mlp(config, layer_index, quant_config, prefix)


class Glm4MoeForCausalLM(CausalLM):
    """GLM-4.5 / 4.6 / 4.7 (and -Air): ``forward(input_ids, positions) -> hidden``; ``compute_logits``."""

    #: loading only filters names; the layers' loaders take the lazy slices as they come
    reads_checkpoint_slices = True

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, quant_config, "model", make_mlp=glm4_moe_mlp)
        self.init_lm_head(config, quant_config, tie_by_default=False)

    #: Routed-expert tensors go to the stacked FusedMoE weights; the rest folds as in Llama.
    map_weight_name = staticmethod(map_expert_weight_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tensors without its multi-token-prediction layers."""
        return load_parameters(self, drop_extra_layers(weights, self.config.num_layers))
