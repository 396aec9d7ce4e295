"""``WNA16FusedMoEMethod``: a FusedMoE's experts in GPTQ / AWQ / compressed-tensors / Marlin form.

The checkpoint's per-expert tensors (``experts.{e}.gate_proj.qweight``, ...) load into stacked
parameters named ``w13_<tensor>`` / ``w2_<tensor>`` (:mod:`fw_gptq.params` per expert, experts on
dim 0; ``feature_dim`` is the axis of the expert's intermediate features: the output axis of
gate/up, the input axis of down), through :meth:`FusedMoE.weight_loader`. After loading each
expert is decoded and the stacks kept as::

    wna16_w1 / _w3 / _w2   int32 [E, K/pf, N]   the kernel layout's qweight of every expert
    wna16_side_w1 / ...    float32 [E, 2*G*N + K]  scales | zeros | groups or perm (as floats), per expert

run by the kernel registry's ``quantized_fused_moe`` op (:class:`framework.ops.PackedExperts`
of type ``wna16:<bits>bit:<grouping>``, :func:`stack_experts`): on CUDA :mod:`fw_gptq.kernels.moe`'s
Triton kernels (``triton_wna16``), elsewhere the torch reference, which gathers and dequantizes the
chosen experts. Act-order experts are sorted by group at load where that makes the groups
contiguous (``perm<size>``: the kernel gathers the activations through ``perm``); otherwise
(``g_idx``) they keep their input order and each input's group is looked up. On the CPU, unless
``FW_GPTQ_KEEP_PACKED=1``, the experts are dequantized once into
``w13_weight`` / ``w2_weight`` and run by the dense ``fused_moe`` op.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from framework.kernels import get_kernel
from framework.layers.linear import set_weight_attrs
from framework.ops import PackedExperts
from framework.quantization import FusedMoEMethod

from .config import ACT_DTYPES, WNA16Scheme
from .method import decode_checkpoint, keep_packed
from .packing import IntWeight, pack_along, unpack_along
from .params import checkpoint_params


def _expert_side(weight: IntWeight, last: Tensor | None = None) -> Tensor:
    """One expert's scales, zeros and groups (or ``last``), flattened into one float32 row."""
    last = weight.group_of() if last is None else last
    return torch.cat([weight.scales.float().flatten(), weight.zero_values().flatten(), last.float()])


def stack_experts(weights: list[IntWeight]) -> tuple[Tensor, Tensor, str]:
    """``(words [E, K/pf, N], side [E, 2GN + K], grouping)`` of experts of one projection, where
    ``grouping`` (the ``quant_type``'s last part) says what the side rows end with:

    * ``g<size>``: every expert's input ``k`` is in group ``k // size``; the groups, as floats;
    * ``perm<size>``: act-order experts whose inputs, sorted by group (``perm = argsort(g_idx)``),
      are in groups ``k' // size``: the words hold input ``perm[k']`` at ``k'``; ``perm``, as floats;
    * ``g_idx``: any other grouping, kept in input order; each input's group, as floats.
    """
    size, k = weights[0].group_size, weights[0].q.shape[0]
    natural = torch.arange(k, device=weights[0].q.device) // size
    same_size = all(w.group_size == size for w in weights)
    perms = None
    if same_size and all(torch.equal(w.group_of(), natural) for w in weights):
        grouping = f"g{size}"
    else:
        perms = [torch.argsort(w.group_of(), stable=True) for w in weights]
        if same_size and all(torch.equal(w.group_of()[p], natural) for w, p in zip(weights, perms)):
            grouping = f"perm{size}"
        else:
            grouping, perms = "g_idx", None
    if perms is None:
        data = torch.stack([pack_along(w.q, w.bits, 0) for w in weights])
        side = torch.stack([_expert_side(w) for w in weights])
    else:
        data = torch.stack([pack_along(w.q[p], w.bits, 0) for w, p in zip(weights, perms)])
        side = torch.stack([_expert_side(w, p) for w, p in zip(weights, perms)])
    return data, side, grouping


def dequantize_experts(
    bits: int, k: int, n: int, data: Tensor, side: Tensor, dtype: torch.dtype, perm_group_size: int | None = None
) -> Tensor:
    """``[E', K/pf, N]`` words and ``[E', 2GN + K]`` side rows of :func:`stack_experts` -> ``[E', N, K]``
    weights in ``dtype``, in the layer's input order (``perm_group_size``: the group size of side rows
    ending with ``perm``; None: ending with each input's group)."""
    groups = (side.shape[1] - k) // (2 * n)
    q = unpack_along(data, bits, 1).float()  # [E', K, N]
    scales = side[:, : groups * n].view(-1, groups, n)
    zeros = side[:, groups * n : 2 * groups * n].view(-1, groups, n)
    last = side[:, 2 * groups * n :].long()  # [E', K]
    permuted = perm_group_size is not None
    g = (torch.arange(k, device=side.device) // perm_group_size).expand_as(last) if permuted else last
    index = g.unsqueeze(-1).expand(-1, -1, n)
    w = ((q - zeros.gather(1, index)) * scales.gather(1, index)).transpose(1, 2)
    if permuted:  # column k' holds input perm[k']
        w = torch.empty_like(w).scatter_(2, last.unsqueeze(1).expand(-1, n, -1), w)
    return w.to(dtype)


class WNA16FusedMoEMethod(FusedMoEMethod):
    """Integer experts of ``scheme``; see the module docstring."""

    supported_act_dtypes = ACT_DTYPES
    supported_device_types = frozenset({"cpu", "cuda"})

    def __init__(self, scheme: WNA16Scheme) -> None:
        self.scheme = scheme

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
    ) -> None:
        width, full = intermediate_size_per_partition, layer.intermediate_size
        shapes = {"w13": (hidden_size, 2 * width, hidden_size), "w2": (width, hidden_size, full)}
        layer.wna16_names = {}
        for projection, (k, n, k_full) in shapes.items():
            where = f"{layer.prefix} ({projection})"
            if projection == "w13":
                checkpoint_params(self.scheme, k, width, k_full, where)  # gate and up each pack on their own
            names = []
            for spec in checkpoint_params(self.scheme, k, n, k_full, where):
                axis = spec.out_axis if projection == "w13" else spec.in_axis
                per_shard = spec.per_shard and projection == "w13"
                shape = (num_experts, *spec.shape, 2) if per_shard else (num_experts, *spec.shape)
                if len(spec.shape) == 1 and axis is not None:  # down's g_idx: FusedMoE splits only 2-D tensors,
                    axis, shape = None, (num_experts, k_full)  # so every rank keeps all and takes its part in _decode
                param = nn.Parameter(torch.empty(shape, dtype=spec.dtype), requires_grad=False)
                feature_dim = None if axis is None or per_shard else axis - len(spec.shape)
                attrs = {"weight_loader": layer.weight_loader, "moe_projection": projection, "feature_dim": feature_dim}
                if per_shard:
                    attrs["per_shard"] = True
                set_weight_attrs(param, attrs)
                layer.register_parameter(f"{projection}_{spec.name}", param)
                names.append(spec.name)
            layer.wna16_names[projection] = names
        layer.wna16_shapes = {"w1": (hidden_size, width), "w3": (hidden_size, width), "w2": (width, hidden_size)}
        self.fused_moe = get_kernel("quantized_fused_moe", prefer="triton_wna16")
        # this plugin's kernel never syncs; any other implementation may run the reference's per-expert loop
        self.graph_safe = self.fused_moe.__module__ == "fw_gptq.kernels.moe"
        self.dense_fused_moe = get_kernel("fused_moe")

    def _decode(self, layer: nn.Module, projection: str, expert: int) -> IntWeight:
        tensors = {}
        for name in layer.wna16_names[projection]:
            value = getattr(layer, f"{projection}_{name}").data[expert]
            tensors[name] = value[..., 0] if value.dim() == 2 and name == "weight_shape" else value
        k = layer.hidden_size if projection == "w13" else layer.intermediate_size_per_partition
        for name in ("g_idx", "weight_g_idx"):
            if name in tensors and tensors[name].shape[0] != k:  # down's: this rank's input features
                tensors[name] = tensors[name].narrow(0, layer.tp_rank * k, k)
        return decode_checkpoint(self.scheme, tensors, k, f"{layer.prefix} expert {expert} {projection}")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        width = layer.intermediate_size_per_partition
        decoded = {p: [self._decode(layer, p, e) for e in range(layer.num_experts)] for p in ("w13", "w2")}
        for projection in ("w13", "w2"):
            for name in layer.wna16_names[projection]:
                delattr(layer, f"{projection}_{name}")
        if decoded["w13"][0].q.device.type == "cpu" and not keep_packed():
            dense = {p: torch.stack([w.dequantize(layer.params_dtype) for w in ws]) for p, ws in decoded.items()}
            layer.w13_weight, layer.w2_weight = nn.Parameter(dense["w13"], False), nn.Parameter(dense["w2"], False)
            layer.wna16_packed = False
            return
        halves = {"w1": [], "w3": []}
        for weight in decoded["w13"]:  # the gate columns [0, I), the up columns [I, 2I)
            for shard, columns in (("w1", slice(0, width)), ("w3", slice(width, 2 * width))):
                halves[shard].append(
                    IntWeight(
                        weight.q[:, columns],
                        weight.scales[:, columns],
                        None if weight.zeros is None else weight.zeros[:, columns],
                        weight.g_idx,
                        weight.bits,
                        weight.group_size,
                    )
                )
        layer.wna16_grouping = {}
        for shard, weights in (*halves.items(), ("w2", decoded["w2"])):
            data, side, layer.wna16_grouping[shard] = stack_experts(weights)
            layer.register_buffer(f"wna16_{shard}", data)
            layer.register_buffer(f"wna16_side_{shard}", side)
        layer.wna16_packed = True

    def packed_experts(self, layer: nn.Module) -> tuple[PackedExperts, PackedExperts, PackedExperts]:
        """``(gate, up, down)`` as the ``quantized_fused_moe`` op takes them."""

        def packed(shard: str) -> PackedExperts:
            k, n = layer.wna16_shapes[shard]
            grouping = layer.wna16_grouping[shard]
            size = int(grouping[4:]) if grouping.startswith("perm") else None
            decode = functools.partial(dequantize_experts, self.scheme.bits, k, n, perm_group_size=size)
            return PackedExperts(
                getattr(layer, f"wna16_{shard}"),
                getattr(layer, f"wna16_side_{shard}"),
                f"wna16:{self.scheme.bits}bit:{grouping}",
                k,
                decode,
            )

        return packed("w1"), packed("w3"), packed("w2")

    def dequantize(self, layer: nn.Module, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        dtype = dtype or layer.params_dtype
        if not layer.wna16_packed:
            return layer.w13_weight.to(dtype), layer.w2_weight.to(dtype)
        gate, up, down = (p.dequantize(p.data, p.scales, dtype) for p in self.packed_experts(layer))
        return torch.cat([gate, up], dim=1), down

    def apply(self, layer: nn.Module, hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        if not layer.wna16_packed:
            return self.dense_fused_moe(hidden, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        if (
            not self.graph_safe
            and topk_ids.numel() > layer.num_experts
            and hidden.is_cuda
            and torch.cuda.is_current_stream_capturing()
        ):
            w13, w2 = self.dequantize(layer, hidden.dtype)  # the reference's per-expert loop would sync in a graph
            return self.dense_fused_moe(hidden, w13, w2, topk_weights, topk_ids)
        return self.fused_moe(hidden, *self.packed_experts(layer), topk_weights, topk_ids)
