"""StableLM's QK norm: a LayerNorm per head, each head with its own weight (``qk_layernorm``)."""

from __future__ import annotations

import re

import torch
from torch import nn

from framework.layers import set_weight_attrs
from framework.layers.linear import KeepsWeightAttrs, copy_weight


class PerHeadLayerNorm(KeepsWeightAttrs):
    """StableLM's QK norm: a LayerNorm (no bias) per head, each with its own weight.

    The heads' weights are one ``weight [num_heads, head_size]`` parameter, so ``forward(x [...,
    num_heads, head_size])`` is one ``layer_norm`` times it. Checkpoints keep one tensor per head
    (``norms.{head}.weight``, as transformers' ``nn.ModuleList`` names them):
    :meth:`LlamaForCausalLM.map_weight_name` sends each to :meth:`weight_loader` with its head.
    Under tensor parallelism a rank holds the ``num_heads`` heads from ``first_head`` on (those of
    its attention shard) and skips the others' weights.
    """

    def __init__(
        self, num_heads: int, head_size: int, eps: float, first_head: int = 0, total_num_heads: int | None = None
    ) -> None:
        super().__init__()
        self.num_heads, self.head_size, self.eps = num_heads, head_size, eps
        self.first_head, self.total_num_heads = first_head, total_num_heads or num_heads
        self.weight = nn.Parameter(torch.ones(num_heads, head_size), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})
        self._loaded_heads: set[int] = set()

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, head: int) -> None:
        """Copy head ``head``'s checkpoint weight ``[head_size]`` into its row (nothing for another rank's head)."""
        if not 0 <= head < self.total_num_heads or tuple(loaded_weight.shape) != (self.head_size,):
            raise ValueError(
                f"per-head norm weight {head} of shape {tuple(loaded_weight.shape)} does not fit: expected "
                f"heads 0..{self.total_num_heads - 1} of shape ({self.head_size},)"
            )
        row = head - self.first_head
        if 0 <= row < self.num_heads:
            copy_weight(param.data[row], loaded_weight)
            self._loaded_heads.add(head)

    def missing_weights(self) -> list[str]:
        """This rank's heads no checkpoint tensor has filled (``check_all_loaded`` reports them)."""
        absent = sorted(set(range(self.first_head, self.first_head + self.num_heads)) - self._loaded_heads)
        return [f"norms.{head}.weight" for head in absent]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, (self.head_size,), eps=self.eps) * self.weight

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_size={self.head_size}, eps={self.eps}"


#: A checkpoint name of one head's QK LayerNorm weight (StableLM): ``...q_layernorm.norms.{head}.weight``.
PER_HEAD_NORM = re.compile(r"^(?P<norm>.*_layernorm)\.norms\.(?P<head>\d+)\.weight$")
