"""The building blocks of model plugins (DESIGN §4): every op goes through the kernel registry.

Import from here: ``from framework.layers import QKVParallelLinear, RMSNorm, get_rope``.
"""

from framework.layers.activation import GeluTanhAndMul, SiluAndMul
from framework.layers.embedding import LMHead, VocabEmbedding
from framework.layers.fused_moe import FusedMoE, UnquantizedFusedMoEMethod, select_experts
from framework.layers.layernorm import LayerNorm, RMSNorm, norm_per_head, residual_norm
from framework.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    LinearMethod,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
    set_weight_attrs,
)
from framework.layers.mlp import GatedMLP
from framework.layers.rotary import RotaryEmbedding, get_rope

__all__ = [
    "ColumnParallelLinear",
    "FusedMoE",
    "GatedMLP",
    "GeluTanhAndMul",
    "LMHead",
    "LayerNorm",
    "LinearBase",
    "LinearMethod",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "UnquantizedFusedMoEMethod",
    "UnquantizedLinearMethod",
    "VocabEmbedding",
    "get_rope",
    "norm_per_head",
    "residual_norm",
    "select_experts",
    "set_weight_attrs",
]
