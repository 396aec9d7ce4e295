"""``Fp8LinearMethod``: one linear layer's FP8 weight, from a checkpoint or quantized at load.

Parameters while loading (this rank's ``N`` outputs, ``K`` inputs; the checkpoint's names)::

    weight            float8_e4m3fn [N, K]    (16-bit [N, K] when quantizing at load)
    weight_scale_inv  float32 [N, ceil(K / 128)]   block weights: one row per output feature (fw_fp8.params)
    weight_scale      float32 [N, 1] (channel) | [shards] (tensor: one per fused shard)
    input_scale       float32 [shards]        static activation scales (kept as their maximum)

:meth:`~Fp8LinearMethod.process_weights_after_loading` leaves the kernel layout
(:mod:`fw_fp8.kernels.layout`, buffers ``fp8_qweight`` / ``fp8_scale``) and the layer's two matmul
paths (:mod:`fw_fp8.kernels.dispatch`); ``apply`` picks one by the number of rows. FP8 weights stay
FP8 everywhere, the CPU included (dequantized per call there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from framework.errors import ConfigError
from framework.layers.linear import set_weight_attrs
from framework.quantization import LinearMethod

from .config import ACT_DTYPES, Fp8Scheme
from .kernels.dispatch import choose_paths
from .kernels.layout import Fp8Weight, collapse_row_scales, dequantize_fp8_weight
from .params import linear_block_scale_loader
from .quantize import FP8_DTYPE, quantize_weight_fp8


def new_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, **attrs) -> None:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(param, {"weight_loader": layer.weight_loader, **attrs})
    layer.register_parameter(name, param)


def check_input_blocks(where: str, k: int, k_full: int, block_cols: int) -> None:
    """A rank's inputs must be whole scale blocks when the inputs are split over ranks."""
    if k != k_full and k % block_cols:
        raise ConfigError(
            f"{where}: block-FP8 weights need each rank's {k} input features (of {k_full}) to be whole "
            f"blocks of {block_cols}; use a tensor-parallel size that splits the inputs into "
            f"multiples of {block_cols}"
        )


class Fp8LinearMethod(LinearMethod):
    """A linear layer's FP8 weight (``scheme``); see the module docstring."""

    supported_act_dtypes = ACT_DTYPES
    supported_device_types = frozenset({"cpu", "cuda"})

    def __init__(self, scheme: Fp8Scheme) -> None:
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
        n, k, scheme = sum(output_partition_sizes), input_size_per_partition, self.scheme
        split = {"output_dim": 0, "input_dim": 1}
        where = getattr(layer, "prefix", "") or type(layer).__name__
        if not scheme.serialized:
            check_input_blocks(where, k, input_size, scheme.block_size[1])
            new_param(layer, "weight", (n, k), params_dtype, **split)
            return
        new_param(layer, "weight", (n, k), FP8_DTYPE, **split)
        shards = len(output_partition_sizes)
        if scheme.weights == "block":
            block_rows, block_cols = scheme.block_size
            check_input_blocks(where, k, input_size, block_cols)
            new_param(layer, scheme.scale_name, (n, -(-k // block_cols)), torch.float32, **split)
            getattr(layer, scheme.scale_name).weight_loader = linear_block_scale_loader(layer, block_rows)
        elif scheme.weights == "channel":
            new_param(layer, "weight_scale", (n, 1), torch.float32, output_dim=0)
        else:
            new_param(layer, "weight_scale", (shards,), torch.float32, per_shard=True)
        if scheme.static_input_scale:
            new_param(layer, "input_scale", (shards,), torch.float32, per_shard=True)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scheme = self.scheme
        input_scale = None
        if not scheme.serialized:
            qweight, scale, scale_rows = quantize_shards(
                layer.weight.data, layer.output_partition_sizes, scheme.block_size
            )
            scale_cols = scheme.block_size[1]
        else:
            qweight = layer.weight.data
            if scheme.weights == "block":
                scale, scale_rows = collapse_row_scales(getattr(layer, scheme.scale_name).data, scheme.block_size[0])
                scale_cols = scheme.block_size[1]
                delattr(layer, scheme.scale_name)
            else:
                scale = layer.weight_scale.data.float()
                if scheme.weights == "tensor":  # one scale per fused shard -> one per output feature
                    sizes = torch.tensor(layer.output_partition_sizes, device=scale.device)
                    scale = scale.repeat_interleave(sizes)
                scale, scale_rows, scale_cols = scale.reshape(-1, 1).contiguous(), 1, qweight.shape[1]
                delattr(layer, "weight_scale")
            if scheme.static_input_scale:
                input_scale = layer.input_scale.data.float().max().reshape(1)
                delattr(layer, "input_scale")
        delattr(layer, "weight")
        layer.register_buffer("fp8_qweight", qweight.contiguous())
        layer.register_buffer("fp8_scale", scale.float().contiguous())
        layer.register_buffer("fp8_input_scale", input_scale)
        layer.fp8_scale_shape = (scale_rows, scale_cols)
        granularity = "block" if scale.shape[1] > 1 or not scheme.serialized else scheme.weights
        layer.fp8_paths = choose_paths(qweight.device, granularity, layer.params_dtype, *qweight.shape)

    @staticmethod
    def kernel_weight(layer: nn.Module) -> Fp8Weight:
        """The layer's weight in the kernel layout (its buffers, wherever ``to()`` moved them)."""
        return Fp8Weight(layer.fp8_qweight, layer.fp8_scale, *layer.fp8_scale_shape)

    def dequantize(self, layer: nn.Module) -> Tensor:
        return dequantize_fp8_weight(self.kernel_weight(layer), layer.params_dtype)

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        weight = self.kernel_weight(layer)
        x2d = x.reshape(-1, x.shape[-1])
        path = layer.fp8_paths.choose(x2d.shape[0]) if x2d.shape[0] else "torch"
        if path == "torch":
            out = F.linear(x2d, dequantize_fp8_weight(weight, x.dtype), bias)
        else:
            out = run_kernel(path, x2d, weight, layer.fp8_input_scale)
            if bias is not None:
                out += bias
        return out.view(*x.shape[:-1], out.shape[-1])


def quantize_shards(weight: Tensor, sizes: list[int], block_size: tuple[int, int]) -> tuple[Tensor, Tensor, int]:
    """``(qweight, scale, scale_rows)``: each fused shard (``sizes`` rows each: q, k, v) quantized to
    blocks of its own, as a checkpoint stores them."""
    parts = [quantize_weight_fp8(shard, block_size) for shard in weight.split(sizes)]
    if len(parts) == 1:
        return parts[0][0], parts[0][1], block_size[0]
    rows = [s.repeat_interleave(block_size[0], 0)[:size] for (_, s), size in zip(parts, sizes)]
    scale, scale_rows = collapse_row_scales(torch.cat(rows), block_size[0])
    return torch.cat([q for q, _ in parts]), scale, scale_rows


def run_kernel(path: str, x: Tensor, weight: Fp8Weight, input_scale: Tensor | None) -> Tensor:
    """``x [M, K] @ W.T`` through the Triton kernel or ``torch._scaled_mm`` named ``path``."""
    if path == "w8a16":
        from .kernels.w8a16 import w8a16_matmul  # Triton: imported only where kernels run

        return w8a16_matmul(x, weight)
    if path == "w8a8_block":
        from .kernels.w8a8_block import w8a8_block_matmul

        return w8a8_block_matmul(x, weight)
    from .kernels.scaled_mm import scaled_mm_linear

    return scaled_mm_linear(x, weight, input_scale)
