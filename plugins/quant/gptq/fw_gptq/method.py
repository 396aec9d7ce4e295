"""``WNA16LinearMethod``: one linear layer's GPTQ / AWQ / compressed-tensors / Marlin weight.

Lifecycle: :meth:`~WNA16LinearMethod.create_weights` registers the checkpoint's own tensors
(:mod:`fw_gptq.params`) with the layer's loaders, so fused layers and tensor parallelism slice
them as any parameter; after loading, :meth:`~WNA16LinearMethod.process_weights_after_loading`
decodes them into :class:`~fw_gptq.packing.IntWeight`, checks ``g_idx``, and keeps either

* on CUDA (or with ``FW_GPTQ_KEEP_PACKED=1``): the kernel layout
  (:mod:`fw_gptq.kernels.layout`, buffers ``wna16_qweight`` / ``_scales`` / ``_zeros`` / ``_g_idx``
  / ``_perm``), multiplied by the Triton core on CUDA and under ``TRITON_INTERPRET=1``, by its
  torch reference elsewhere;
* on the CPU: the dequantized matrix in the model dtype (``wna16_dense``; a per-step dequantization
  would cost more than the matmul there).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from framework.errors import ConfigError
from framework.layers.linear import set_weight_attrs
from framework.quantization import LinearMethod

from .config import ACT_DTYPES, WNA16Scheme
from .kernels.layout import KernelWeight, dequantize_kernel_weight, to_kernel_layout
from .packing import IntWeight, unpack_awq, unpack_compressed, unpack_gptq, unpack_marlin
from .params import checkpoint_params

KERNEL_BUFFERS = ("qweight", "scales", "zeros", "g_idx", "perm")


def keep_packed() -> bool:
    """``FW_GPTQ_KEEP_PACKED=1``: keep the kernel layout on the CPU too (the GPU's path, for tests)."""
    return os.environ.get("FW_GPTQ_KEEP_PACKED", "") not in ("", "0")


def kernels_run_here(x: Tensor) -> bool:
    """Whether the Triton core can multiply ``x`` (CUDA, or the CPU under the interpreter)."""
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)) or os.environ.get("TRITON_INTERPRET") == "1"


def decode_checkpoint(scheme: WNA16Scheme, tensors: dict[str, Tensor], k: int, where: str) -> IntWeight:
    """The checkpoint tensors of one weight (``k`` input features, this rank's) as an IntWeight, with
    its ``g_idx`` checked (a ConfigError naming ``where`` when it cannot be this weight's)."""
    group = scheme.group_width(k) if scheme.group_size == -1 else scheme.group_size
    if scheme.format == "gptq":
        g_idx = tensors["g_idx"] if scheme.desc_act else None
        weight = unpack_gptq(
            tensors["qweight"], tensors["qzeros"], tensors["scales"], g_idx, scheme.bits, group, scheme.zero_offset
        )
    elif scheme.format == "awq":
        weight = unpack_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], group)
    elif scheme.format == "marlin":
        weight = unpack_marlin(tensors["B"], tensors["s"], group)
    else:
        weight = unpack_compressed(
            tensors["weight_packed"],
            tensors["weight_scale"],
            tensors.get("weight_zero_point"),
            tensors.get("weight_g_idx"),
            scheme.bits,
            group,
        )
    if weight.g_idx is not None:
        check_g_idx(weight.g_idx, weight.scales.shape[0], where)
    return weight


def check_g_idx(g_idx: Tensor, num_groups: int, where: str) -> None:
    """Refuse a ``g_idx`` naming a group the scales do not have."""
    low, high = int(g_idx.min()), int(g_idx.max())
    if low < 0 or high >= num_groups:
        raise ConfigError(
            f"{where}: g_idx names groups {low}..{high} but the weight has {num_groups} groups of "
            "scales; the checkpoint's g_idx does not match its scales (desc_act / group_size)"
        )


class WNA16LinearMethod(LinearMethod):
    """A linear layer's integer weight (``scheme``); see the module docstring."""

    supported_act_dtypes = ACT_DTYPES
    supported_device_types = frozenset({"cpu", "cuda"})

    def __init__(self, scheme: WNA16Scheme) -> None:
        self.scheme = scheme

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        where = getattr(layer, "prefix", "") or type(layer).__name__
        for size in output_partition_sizes:  # every fused shard must pack on its own
            checkpoint_params(self.scheme, input_size_per_partition, size, input_size, where)
        specs = checkpoint_params(self.scheme, input_size_per_partition, sum(output_partition_sizes), input_size, where)
        num_shards = len(output_partition_sizes)
        for spec in specs:
            shape = (num_shards, *spec.shape) if spec.per_shard else spec.shape
            param = nn.Parameter(torch.empty(shape, dtype=spec.dtype), requires_grad=False)
            attrs = {"weight_loader": _discard if spec.unused else layer.weight_loader}
            if spec.in_axis is not None:
                attrs["input_dim"] = spec.in_axis
            if spec.out_axis is not None:
                attrs["output_dim"] = spec.out_axis
            if spec.per_shard:
                attrs["per_shard"] = True
            set_weight_attrs(param, attrs)
            layer.register_parameter(spec.name, param)
        layer.wna16_names = [spec.name for spec in specs]
        layer.wna16_weight = None
        layer.register_buffer("wna16_dense", None)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        tensors = {name: getattr(layer, name).data for name in layer.wna16_names}
        if self.scheme.format == "compressed":
            check_weight_shapes(layer, tensors["weight_shape"])
        weight = self._decode_shards(layer, tensors)
        for name in layer.wna16_names:
            delattr(layer, name)
        if weight.q.device.type == "cpu" and not keep_packed():
            layer.wna16_dense = weight.dequantize(layer.params_dtype)
            return
        packed = to_kernel_layout(weight, layer.params_dtype)
        if packed.qweight.is_cuda:
            from .kernels.gemv_int8 import reserve_counters  # before any CUDA-graph capture uses them

            reserve_counters(packed.qweight.device)
        for name, tensor in zip(KERNEL_BUFFERS, packed[:5]):
            layer.register_buffer(f"wna16_{name}", tensor)
        layer.wna16_weight = packed._replace(qweight=None, scales=None, zeros=None, g_idx=None, perm=None)

    def _decode_shards(self, layer: nn.Module, tensors: dict[str, Tensor]) -> IntWeight:
        """Decode each fused shard's columns on its own (Marlin's tiles do not span shards), then join."""
        sizes, k = layer.output_partition_sizes, layer.input_size_per_partition
        specs = {s.name: s for s in checkpoint_params(self.scheme, k, sum(sizes), layer.input_size, layer.prefix)}
        parts, start = [], 0
        for index, size in enumerate(sizes):
            shard = {}
            for name, tensor in tensors.items():
                spec = specs[name]
                if spec.per_shard:
                    shard[name] = tensor[index]
                elif spec.out_axis is None:
                    shard[name] = tensor
                else:
                    entries = tensor.shape[spec.out_axis]  # entries per feature: 2 (Marlin), 1 or 1/pf (packed)
                    shard[name] = tensor.narrow(
                        spec.out_axis, start * entries // sum(sizes), size * entries // sum(sizes)
                    )
            parts.append(decode_checkpoint(self.scheme, shard, k, f"{layer.prefix} shard {index}"))
            start += size
        return join_columns(parts)

    @staticmethod
    def kernel_weight(layer: nn.Module) -> KernelWeight:
        """The layer's kernel-layout weight (its buffers, wherever ``to()`` moved them)."""
        return layer.wna16_weight._replace(**{name: getattr(layer, f"wna16_{name}") for name in KERNEL_BUFFERS})

    def dequantize(self, layer: nn.Module) -> Tensor:
        if layer.wna16_dense is not None:
            return layer.wna16_dense
        return dequantize_kernel_weight(self.kernel_weight(layer), layer.params_dtype)

    def activation_group(self, layer: nn.Module, x: Tensor) -> int | None:
        """32 where :meth:`apply` runs the integer GEMV (one row on CUDA, see
        :func:`~fw_gptq.kernels.wna16.int8_gemv_chosen`: x rounded to int8 per 32 inputs), else ``None``."""
        if layer.wna16_dense is not None or x.numel() != x.shape[-1] or not kernels_run_here(x):
            return None
        from .kernels.wna16 import int8_gemv_chosen

        return 32 if int8_gemv_chosen(self.kernel_weight(layer), x.reshape(1, -1)) else None

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        if layer.wna16_dense is not None:
            return F.linear(x, layer.wna16_dense, bias)
        weight = self.kernel_weight(layer)
        x2d = x.reshape(-1, x.shape[-1])
        if kernels_run_here(x2d) and x2d.shape[0] > 0:
            from .kernels.wna16 import wna16_matmul  # Triton: imported only where kernels run

            out = wna16_matmul(x2d, weight)
            if bias is not None:
                out += bias
        else:
            out = F.linear(x2d, dequantize_kernel_weight(weight, x.dtype), bias)
        return out.view(*x.shape[:-1], out.shape[-1])


def join_columns(parts: list[IntWeight]) -> IntWeight:
    """Weights of the same inputs side by side (fused shards): one IntWeight of all their columns."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([p.zero_values().to(torch.uint8) for p in parts], dim=1)
    return IntWeight(
        torch.cat([p.q for p in parts], 1),
        torch.cat([p.scales for p in parts], 1),
        zeros,
        first.g_idx,
        first.bits,
        first.group_size,
    )


def _discard(param: Tensor, loaded_weight: Tensor, shard_id=None) -> None:
    """Loader of a checkpoint tensor fw does not use (Marlin's kernel workspace)."""


def check_weight_shapes(layer: nn.Module, shapes: Tensor) -> None:
    """compressed-tensors' ``weight_shape`` of each fused shard must be the full weight the layer expects."""
    from framework.layers.linear import QKVParallelLinear

    expected_rows = [size * layer.tp_size for size in layer.output_partition_sizes]
    if isinstance(layer, QKVParallelLinear):
        expected_rows = [layer.total_num_heads * layer.head_size] + [layer.total_num_kv_heads * layer.head_size] * 2
    elif not hasattr(layer, "output_sizes"):
        expected_rows = [layer.output_size]
    for index, rows in enumerate(expected_rows):
        got = tuple(int(v) for v in shapes[index].tolist())
        if got != (rows, layer.input_size):
            raise ConfigError(
                f"{layer.prefix}: weight_shape of shard {index} is {got}, the model expects {(rows, layer.input_size)}"
            )
