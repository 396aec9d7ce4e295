"""AWQ (Lin et al., 2023): scale each input channel of a group of linear layers by
``s = mean|x| ** alpha`` before rounding (salient channels keep more precision), choosing ``alpha``
by the output error on calibration inputs, and fold ``1 / s`` into the operation that produces
those inputs (an RMSNorm's weight, or the rows of the previous linear layer), so the model computes
the same function before rounding. AWQ's weight-clipping search is not done."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .calibrate import InputStats
from .rtn import round_to_nearest

GRID = 20


def search_scale(weights: list[Tensor], stats: InputStats, bits: int, group_size: int, symmetric: bool) -> Tensor:
    """The per-input-channel scale ``[K]`` minimising ``|X W^T - X Q(W s)/s ^T|`` summed over ``weights``."""
    x = stats.rows
    mean = stats.mean_abs.clamp_min(1e-6)
    reference = [x @ w.float().t() for w in weights]
    best, best_scale = float("inf"), torch.ones_like(mean)
    for step in range(GRID):
        alpha = step / GRID
        scale = mean.pow(alpha)
        scale = scale / (scale.max() * scale.min()).sqrt()
        loss = 0.0
        for w, out in zip(weights, reference):
            scaled = w.float() * scale
            deq = round_to_nearest(scaled, bits, group_size, symmetric).dequantize() / scale
            loss += float(((x @ deq.t() - out) ** 2).mean())
        if loss < best:
            best, best_scale = loss, scale
    return best_scale


def fold_scale(previous: nn.Module, linears: list[nn.Linear], scale: Tensor, norm_offset: float) -> None:
    """``linears``' input channels times ``scale``, ``previous``'s output channels divided by it.
    ``norm_offset``: the norm multiplies by ``offset + weight`` (1 for Gemma's RMSNorm, else 0)."""
    with torch.no_grad():
        for linear in linears:
            linear.weight.mul_(scale.to(linear.weight.dtype))
        if isinstance(previous, nn.Linear):
            previous.weight.div_(scale.to(previous.weight.dtype)[:, None])
            if previous.bias is not None:
                previous.bias.div_(scale.to(previous.bias.dtype))
        else:
            weight = previous.weight
            weight.copy_(((norm_offset + weight.float()) / scale - norm_offset).to(weight.dtype))


def scaling_groups(layer: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """``[(previous op, [linear names in the layer])]`` AWQ scales in one Llama/Gemma/Qwen decoder layer."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [(layer.input_layernorm, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])]
    if attn.v_proj.weight.shape[0] == attn.o_proj.weight.shape[1]:  # GQA: o_proj's inputs are not v_proj's rows
        groups.append((attn.v_proj, ["self_attn.o_proj"]))
    mlp_norm = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm
    groups.append((mlp_norm, ["mlp.gate_proj", "mlp.up_proj"]))
    groups.append((mlp.up_proj, ["mlp.down_proj"]))
    return groups
