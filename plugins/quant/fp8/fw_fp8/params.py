"""Block scales as parameters: one scale row per output feature while loading.

A checkpoint stores ``weight_scale_inv [ceil(rows / 128), ceil(K / 128)]`` per tensor. Fused layers
(q | k | v, gate | up) and tensor-parallel slices need not start on a 128-row block (a 64-row
``k_proj``, a rank's slice of 96 rows), so the loaders expand each checkpoint tensor to one row per
output feature (:func:`expand_block_rows`) and hand it to the layer's own loader, which then slices
and places it exactly like the weight. After loading, rows that agree per block fold back
(:func:`fw_fp8.kernels.layout.collapse_row_scales`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from framework.loader.checkpoint_slice import materialize


def expand_block_rows(loaded: Any, rows: int, block_rows: int, where: str) -> Tensor:
    """``loaded [..., ceil(rows / block_rows), C]`` with each row repeated for the ``rows`` features it scales."""
    loaded = materialize(loaded)
    expected = -(-rows // block_rows)
    if loaded.dim() < 2 or loaded.shape[-2] != expected:
        raise ValueError(
            f"{where}: block scales of shape {tuple(loaded.shape)} do not fit a weight of {rows} rows "
            f"in blocks of {block_rows} (expected {expected} scale rows)"
        )
    return loaded.repeat_interleave(block_rows, -2)[..., :rows, :]


def checkpoint_rows(layer: nn.Module, shard_id: Any) -> int:
    """Rows of the (unsplit) checkpoint weight that shard ``shard_id`` of ``layer`` loads from."""
    from framework.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if shard_id is None:
        return layer.output_size
    if isinstance(layer, QKVParallelLinear):
        return (layer.total_num_heads if shard_id == "q" else layer.total_num_kv_heads) * layer.head_size
    if isinstance(layer, MergedColumnParallelLinear):
        return layer.output_sizes[shard_id]
    return layer.output_size


def linear_block_scale_loader(layer: nn.Module, block_rows: int):
    """The ``weight_loader`` of a linear layer's per-feature block-scale parameter."""

    def load(param: Tensor, loaded_weight: Any, shard_id: Any = None) -> None:
        rows = checkpoint_rows(layer, shard_id)
        where = f"{layer.prefix}{'' if shard_id is None else f' shard {shard_id}'}"
        layer.weight_loader(param, expand_block_rows(loaded_weight, rows, block_rows, where), shard_id)

    return load


def moe_block_scale_loader(layer: nn.Module, block_rows: int):
    """The ``weight_loader`` of a FusedMoE's per-feature block-scale parameter (``w13_*`` or ``w2_*``)."""

    def load(param: Tensor, loaded_weight: Any, shard_id: str, expert_id: int | None = None) -> None:
        rows = {
            "w1": layer.intermediate_size,
            "w3": layer.intermediate_size,
            "w13": 2 * layer.intermediate_size,
            "w2": layer.hidden_size,
        }.get(shard_id, 0)
        where = f"{layer.prefix} {shard_id}" + ("" if expert_id is None else f" expert {expert_id}")
        layer.weight_loader(param, expand_block_rows(loaded_weight, rows, block_rows, where), shard_id, expert_id)

    return load
