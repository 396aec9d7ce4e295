"""How a model's dimensions split over the tensor-parallel ranks (the one place that decides)."""

from __future__ import annotations

from typing import NamedTuple

from framework.errors import ConfigError


class AttentionHeads(NamedTuple):
    """One rank's share of an attention layer.

    ``num_heads`` query heads and ``num_kv_heads`` key/value heads on this rank; each KV head is
    held by ``num_kv_head_replicas`` consecutive ranks (more than 1 when there are fewer KV
    heads than ranks: GQA/MQA models replicate them instead of splitting).
    """

    num_heads: int
    num_kv_heads: int
    num_kv_head_replicas: int


def attention_heads_per_rank(total_num_heads: int, total_num_kv_heads: int, tp_size: int) -> AttentionHeads:
    """Split ``total_num_heads`` query heads evenly; split or replicate the KV heads.

    >>> attention_heads_per_rank(32, 8, 2)
    AttentionHeads(num_heads=16, num_kv_heads=4, num_kv_head_replicas=1)
    >>> attention_heads_per_rank(8, 2, 4)
    AttentionHeads(num_heads=2, num_kv_heads=1, num_kv_head_replicas=2)
    """
    if total_num_heads % tp_size:
        raise ConfigError(
            f"the model's {total_num_heads} attention heads cannot be split over {tp_size} tensor-parallel "
            f"ranks; use a tensor-parallel size that divides {total_num_heads}"
        )
    if tp_size >= total_num_kv_heads:
        if tp_size % total_num_kv_heads:
            raise ConfigError(
                f"tensor-parallel size {tp_size} is not a multiple of the model's {total_num_kv_heads} KV heads"
            )
        return AttentionHeads(total_num_heads // tp_size, 1, tp_size // total_num_kv_heads)
    if total_num_kv_heads % tp_size:
        raise ConfigError(
            f"the model's {total_num_kv_heads} KV heads cannot be split over {tp_size} tensor-parallel ranks"
        )
    return AttentionHeads(total_num_heads // tp_size, total_num_kv_heads // tp_size, 1)


def pad_to_multiple(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple`` (the vocabulary padding of sharded tables)."""
    return -(-size // multiple) * multiple
