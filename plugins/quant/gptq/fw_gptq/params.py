"""Each format's checkpoint tensors of one weight, as parameters: names, shapes and split axes.

A weight of ``k`` input and ``n`` output features (this rank's) is stored as (``pf = 32 // bits``,
``G`` groups)::

    gptq        qweight [k/pf, n]   qzeros [G, n/pf]     scales [G, n]        g_idx [k]
    awq         qweight [k, n/8]    qzeros [G, n/8]      scales [G, n]
    compressed  weight_packed [n, k/pf]   weight_scale [n, G]   weight_zero_point [n/pf, G] (asymmetric)
                weight_g_idx [k] (actorder)   weight_shape [2]
    marlin      B [k/16, 2n]        s [G, n]             workspace (unused)

``in_axis`` / ``out_axis`` say which axis runs along input / output features (None: not split
along them). The group axis is split with the input features, except for act-order weights whose
inputs are split (each rank's ``g_idx`` may name any group: every rank keeps every group) and for
channel-wise weights (one group).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from framework.errors import ConfigError

from .config import WNA16Scheme


class ParamSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    in_axis: int | None
    out_axis: int | None
    per_shard: bool = False  # one entry per fused shard (compressed-tensors' weight_shape)
    unused: bool = False  # loaded and dropped (Marlin's workspace)


def keeps_all_groups(scheme: WNA16Scheme, k: int, k_full: int) -> bool:
    """Whether every rank keeps every group: act-order weights whose input features are split."""
    return scheme.desc_act and k != k_full and scheme.group_size != -1


def checkpoint_params(scheme: WNA16Scheme, k: int, n: int, k_full: int, where: str) -> list[ParamSpec]:
    """The parameters of ``scheme``'s checkpoint tensors for a ``[n, k]`` weight (``k_full``: the
    unsplit input features); refuses sizes the format cannot pack with a ConfigError naming ``where``."""
    pf, i32 = scheme.pack_factor, torch.int32
    all_groups = keeps_all_groups(scheme, k, k_full)
    groups = scheme.groups(k_full if all_groups else k)
    group_axis = None if all_groups or scheme.group_size == -1 else 0
    check_sizes(scheme, k, n, where, k_full)
    if scheme.format == "gptq":
        return [
            ParamSpec("qweight", (k // pf, n), i32, 0, 1),
            ParamSpec("qzeros", (groups, n // pf), i32, group_axis, 1),
            ParamSpec("scales", (groups, n), torch.float32, group_axis, 1),
            ParamSpec("g_idx", (k,), i32, 0, None),
        ]
    if scheme.format == "awq":
        return [
            ParamSpec("qweight", (k, n // 8), i32, 0, 1),
            ParamSpec("qzeros", (groups, n // 8), i32, group_axis, 1),
            ParamSpec("scales", (groups, n), torch.float32, group_axis, 1),
        ]
    if scheme.format == "marlin":
        return [
            ParamSpec("B", (k // 16, 2 * n), i32, 0, 1),
            ParamSpec("s", (groups, n), torch.float32, group_axis, 1),
            ParamSpec("workspace", (0,), i32, None, None, unused=True),
        ]
    ct_group_axis = None if group_axis is None else 1
    specs = [
        ParamSpec("weight_packed", (n, k // pf), i32, 1, 0),
        ParamSpec("weight_scale", (n, groups), torch.float32, ct_group_axis, 0),
        ParamSpec("weight_shape", (2,), torch.int64, None, None, per_shard=True),
    ]
    if not scheme.symmetric:
        specs.append(ParamSpec("weight_zero_point", (n // pf, groups), i32, ct_group_axis, 0))
    if scheme.desc_act:
        specs.append(ParamSpec("weight_g_idx", (k,), i32, 0, None))
    return specs


def check_sizes(scheme: WNA16Scheme, k: int, n: int, where: str, k_full: int | None = None) -> None:
    """Refuse a ``[n, k]`` weight (this rank's) the format cannot store in whole words and groups. A
    last group shorter than the others is fine (576 inputs in groups of 128) unless the inputs are
    split over ranks (each rank must hold whole groups)."""
    pf = scheme.pack_factor
    problems = []
    split = k_full is not None and k != k_full
    if scheme.group_size != -1 and k % scheme.group_size and split and not scheme.desc_act:
        problems.append(f"{k} input features are not a whole number of groups of {scheme.group_size}")
    if scheme.format in ("gptq", "compressed") and k % pf:
        problems.append(f"{k} input features do not fill whole int32 words of {pf} values")
    if scheme.format in ("gptq", "awq") and n % pf:
        problems.append(f"{n} output features do not fill whole int32 words of zero points ({pf} values)")
    if scheme.format == "compressed" and not scheme.symmetric and n % pf:
        problems.append(f"{n} output features do not fill whole int32 words of zero points ({pf} values)")
    if scheme.format == "marlin" and (k % 16 or n % 16 or (k * n) % 1024):
        problems.append(
            f"Marlin tiles need input and output features divisible by 16 and whole blocks of 1024 "
            f"values, got {k} x {n}"
        )
    if problems:
        raise ConfigError(
            f"{where}: {scheme.format} {scheme.bits}-bit weights of this rank ({n} x {k}): "
            f"{'; '.join(problems)} (a smaller tensor-parallel size may help)"
        )
