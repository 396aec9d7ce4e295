"""``Fp8FusedMoEMethod``: a FusedMoE's experts in FP8, block-, channel- or tensor-scaled per expert.

Parameters while loading (``E`` experts, ``I`` this rank's intermediate features, ``H`` hidden)::

    w13_weight  float8_e4m3fn [E, 2I, H]     w2_weight  [E, H, I]        (16-bit when quantizing at load)
    block:   w13_weight_scale_inv float32 [E, 2I, ceil(H / 128)]   w2_weight_scale_inv [E, H, ceil(I / 128)]
             (one row per output feature while loading, as for linear layers: fw_fp8.params)
    channel: w13_weight_scale [E, 2I, 1]     w2_weight_scale [E, H, 1]
    tensor:  w13_weight_scale [E, 2] (gate, up)   w2_weight_scale [E]
    static inputs: w13_input_scale [E, 2]    w2_input_scale [E]      (loaded, unused: experts run W8A16)

After loading, gate, up and down are kept as ``(fp8 bytes [E, N, K], scales [E, N / rows, C])`` and run
by the kernel registry's ``quantized_fused_moe`` op (:class:`framework.ops.PackedExperts`, type
``fp8:e4m3:<scale rows>x<scale cols>``): on CUDA :mod:`fw_fp8.kernels.moe`'s Triton kernels
(``triton_fp8``), elsewhere the torch reference, which dequantizes the chosen experts.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from framework.errors import ConfigError
from framework.kernels import get_kernel
from framework.layers.linear import set_weight_attrs
from framework.ops import PackedExperts
from framework.quantization import FusedMoEMethod

from .config import ACT_DTYPES, Fp8Scheme
from .kernels.layout import collapse_row_scales, dequantize_fp8
from .params import moe_block_scale_loader
from .quantize import FP8_DTYPE, quantize_weight_fp8


def decode_experts(scale_rows: int, scale_cols: int, data: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """``PackedExperts.dequantize``: uint8 views of FP8 ``[E', N, K]`` and their scales -> ``[E', N, K]``."""
    return dequantize_fp8(data.view(FP8_DTYPE), scales, scale_rows, scale_cols, dtype)


class Fp8FusedMoEMethod(FusedMoEMethod):
    """FP8 experts of ``scheme``; see the module docstring."""

    supported_act_dtypes = ACT_DTYPES
    supported_device_types = frozenset({"cpu", "cuda"})

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def _param(self, layer, name, shape, dtype, projection, feature_dim, **attrs) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        set_weight_attrs(
            param,
            {"weight_loader": layer.weight_loader, "moe_projection": projection, "feature_dim": feature_dim, **attrs},
        )
        layer.register_parameter(name, param)
        return param

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
    ) -> None:
        e, h, i, scheme = num_experts, hidden_size, intermediate_size_per_partition, self.scheme
        weight_dtype = FP8_DTYPE if scheme.serialized else params_dtype
        self._param(layer, "w13_weight", (e, 2 * i, h), weight_dtype, "w13", -2)
        self._param(layer, "w2_weight", (e, h, i), weight_dtype, "w2", -1)
        if scheme.serialized and scheme.weights == "block":
            block_rows, block_cols = scheme.block_size
            if i != layer.intermediate_size and i % block_cols:
                raise ConfigError(
                    f"{layer.prefix}: block-FP8 experts need each rank's {i} intermediate features (of "
                    f"{layer.intermediate_size}) to be whole blocks of {block_cols}; use a "
                    f"tensor-parallel size that splits them into multiples of {block_cols}"
                )
            loader = moe_block_scale_loader(layer, block_rows)
            name = scheme.scale_name
            self._param(
                layer, f"w13_{name}", (e, 2 * i, -(-h // block_cols)), torch.float32, "w13", -2, weight_loader=loader
            )
            self._param(layer, f"w2_{name}", (e, h, -(-i // block_cols)), torch.float32, "w2", -1, weight_loader=loader)
        elif scheme.serialized and scheme.weights == "channel":
            self._param(layer, "w13_weight_scale", (e, 2 * i, 1), torch.float32, "w13", -2)
            self._param(layer, "w2_weight_scale", (e, h, 1), torch.float32, "w2", None)
        elif scheme.serialized:
            self._param(layer, "w13_weight_scale", (e, 2), torch.float32, "w13", None, per_shard=True)
            self._param(layer, "w2_weight_scale", (e,), torch.float32, "w2", None)
        if scheme.serialized and scheme.static_input_scale:
            self._param(layer, "w13_input_scale", (e, 2), torch.float32, "w13", None, per_shard=True)
            self._param(layer, "w2_input_scale", (e,), torch.float32, "w2", None)
        self.fused_moe = get_kernel("quantized_fused_moe", prefer="triton_fp8")
        # this plugin's kernel never syncs; any other implementation may run the reference's per-expert loop
        self.graph_safe = self.fused_moe.__module__ == "fw_fp8.kernels.moe"
        self.dense_fused_moe = get_kernel("fused_moe")

    def _row_scales(self, layer: nn.Module) -> dict[str, Tensor]:
        """Each projection's loaded scales with one row per output feature: ``w13 [E, 2I, C]``, ``w2 [E, H, C]``."""
        scheme = self.scheme
        name = scheme.scale_name if scheme.weights == "block" else "weight_scale"
        w13, w2 = (getattr(layer, f"{p}_{name}").data.float() for p in ("w13", "w2"))
        if scheme.weights == "tensor":  # [E, 2] (gate, up) and [E]: one per expert tensor
            w13 = w13.repeat_interleave(layer.intermediate_size_per_partition, 1).unsqueeze(-1)
            w2 = w2.view(-1, 1, 1).expand(-1, layer.hidden_size, 1)
        return {"w13": w13, "w2": w2}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        width, scheme = layer.intermediate_size_per_partition, self.scheme
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        weights = {"w1": w13[:, :width], "w3": w13[:, width:], "w2": w2}
        if scheme.serialized:
            row_scales = self._row_scales(layer)
            scales = {"w1": row_scales["w13"][:, :width], "w3": row_scales["w13"][:, width:], "w2": row_scales["w2"]}
        layer.fp8_layouts = {}
        for shard, weight in weights.items():
            if not scheme.serialized:  # each expert's gate, up and down on their own blocks
                pairs = [quantize_weight_fp8(w, scheme.block_size) for w in weight]
                weight, scale = torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
                rows, cols = scheme.block_size
            elif scheme.weights == "block":
                (scale, rows), cols = collapse_row_scales(scales[shard], scheme.block_size[0]), scheme.block_size[1]
            else:
                scale, rows, cols = scales[shard], 1, weight.shape[-1]
            layer.register_buffer(f"fp8_{shard}", weight.contiguous().view(torch.uint8))
            layer.register_buffer(f"fp8_scale_{shard}", scale.float().contiguous())
            layer.fp8_layouts[shard] = (rows, cols, weight.shape[-1])
        for name in [n for n, _ in layer.named_parameters(recurse=False) if n.startswith(("w13_", "w2_"))]:
            delattr(layer, name)

    def packed_experts(self, layer: nn.Module) -> tuple[PackedExperts, PackedExperts, PackedExperts]:
        """``(gate, up, down)`` as the ``quantized_fused_moe`` op takes them."""

        def packed(shard: str) -> PackedExperts:
            rows, cols, k = layer.fp8_layouts[shard]
            return PackedExperts(
                getattr(layer, f"fp8_{shard}"),
                getattr(layer, f"fp8_scale_{shard}"),
                f"fp8:e4m3:{rows}x{cols}",
                k,
                functools.partial(decode_experts, rows, cols),
            )

        return packed("w1"), packed("w3"), packed("w2")

    def dequantize(self, layer: nn.Module, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        dtype = dtype or layer.params_dtype
        gate, up, down = (p.dequantize(p.data, p.scales, dtype) for p in self.packed_experts(layer))
        return torch.cat([gate, up], dim=1), down

    def apply(self, layer: nn.Module, hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        if (
            not self.graph_safe
            and topk_ids.numel() > layer.num_experts
            and hidden.is_cuda
            and torch.cuda.is_current_stream_capturing()
        ):
            w13, w2 = self.dequantize(layer, hidden.dtype)  # the reference's per-expert loop would sync in a graph
            return self.dense_fused_moe(hidden, w13, w2, topk_weights, topk_ids)
        return self.fused_moe(hidden, *self.packed_experts(layer), topk_weights, topk_ids)
