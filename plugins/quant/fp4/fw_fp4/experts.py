"""``Fp4ExpertsMethod``: the MoE experts of NVFP4 (modelopt, compressed-tensors) and compressed-tensors
MXFP4 checkpoints, kept in FP4 and multiplied as W4A16 by the ``quantized_fused_moe`` op.

Each expert's projection is stored as the dense layers' tensors (``fw_fp4.nvfp4``,
``fw_fp4.mxfp4_linear``), one per expert (``experts.N.gate_proj.weight_packed``) or stacked over the
experts; ``framework.layers.fused_moe.expert_weight_target`` routes them to these parameters
(per rank ``I`` intermediate features, ``G`` = 16 for NVFP4, 32 for MXFP4)::

    w13_<packed> uint8 [E, 2I, H/2]        w13_weight_scale [E, 2I, H/G]     (gate rows, then up rows)
    w2_<packed>  uint8 [E, H, I/2]         w2_weight_scale  [E, H, I/G]
    NVFP4 only:  w13_<global> f32 [E, 2] (gate's, up's: each shard its own)    w2_<global> f32 [E]
                 w13_<input> / w2_<input>  (the activations' scales: read, unused, W4A16)

``<packed>``, ``<global>``, ``<input>`` are the layout's names (``weight`` / ``weight_scale_2`` /
``input_scale`` for modelopt, ``weight_packed`` / ``weight_global_scale`` / ``input_global_scale``
for compressed-tensors); NVFP4 scales are float8_e4m3fn, MXFP4's e8m0 bytes (uint8).

After loading: ``fp4_w13`` / ``fp4_w2`` rows of ``K/2`` bytes (as stored), ``fp4_*_scales`` bytes
(e4m3 as stored; e8m0 rebased by +14, ``fw_fp4.formats.fold_scale_bias``) and, for NVFP4, the float32
factor per expert of gate, up and down in the multiplying convention (``fp4_w1_global``,
``fp4_w3_global``, ``fp4_w2_global``), which :class:`~framework.ops.PackedExperts` carries as
``global_scales``. Tensor parallelism slices the intermediate features (rows of w13, bytes and
scale groups of w2), so each rank needs whole groups.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from framework.errors import ConfigError
from framework.kernels import get_kernel
from framework.layers.fused_moe import create_expert_biases
from framework.layers.linear import set_weight_attrs
from framework.ops import PackedExperts
from framework.quantization import FusedMoEMethod

from .config import ACT_DTYPES
from .formats import MXFP4_BLOCK, NVFP4_GROUP, dequantize_nvfp4, fold_scale_bias, nvfp4_row_scale
from .moe import dequantize_rows as dequantize_mxfp4_rows
from .nvfp4 import LAYOUTS as NVFP4_LAYOUTS

#: Checkpoint layout -> (``PackedExperts.quant_type``, features per scale).
FORMATS = {
    "modelopt": ("nvfp4", NVFP4_GROUP),
    "compressed-tensors": ("nvfp4", NVFP4_GROUP),
    "compressed-tensors-mxfp4": ("mxfp4", MXFP4_BLOCK),
}


def dequantize_nvfp4_rows(data: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """``[n, rows, K/2]`` bytes (low nibble first) and ``[n, rows, K/16]`` e4m3 scale bytes ->
    ``[n, rows, K]`` values ``e2m1 * scale`` (without the global scale: ``PackedExperts.global_scales``)."""
    return dequantize_nvfp4(data, scales.view(torch.float8_e4m3fn), None, dtype)


class Fp4ExpertsMethod(FusedMoEMethod):
    """FP4 experts of ``layout`` (a key of :data:`FORMATS`); see the module docstring."""

    supported_act_dtypes = ACT_DTYPES
    supported_device_types = frozenset({"cpu", "cuda"})
    supports_moe_activation = True

    def __init__(self, layout: str) -> None:
        if layout not in FORMATS:
            raise ValueError(f"FP4 experts layout {layout!r}; valid: {sorted(FORMATS)}")
        self.layout = layout
        self.quant_type, self.group = FORMATS[layout]
        if self.quant_type == "nvfp4":
            self.packed_name, self.global_name, self.input_name, self.convention = NVFP4_LAYOUTS[layout]
        else:
            self.packed_name, self.global_name = "weight_packed", None

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
    ) -> None:
        width = intermediate_size_per_partition
        for name, features in (("hidden size", hidden_size), ("experts' intermediate size per rank", width)):
            if features % self.group:
                raise ConfigError(
                    f"{layer.prefix}: the {name} {features} is not a multiple of {self.quant_type.upper()}'s "
                    f"group of {self.group} (with tensor parallelism: use a size that leaves each rank whole groups)"
                )
        scale_dtype = torch.float8_e4m3fn if self.quant_type == "nvfp4" else torch.uint8
        # w13's intermediate features are its rows (dim -2), w2's its inputs (dim -1)
        for projection, rows, k, dim in (("w13", 2 * width, hidden_size, -2), ("w2", hidden_size, width, -1)):
            self._register(layer, f"{projection}_{self.packed_name}", (num_experts, rows, k // 2), torch.uint8, dim)
            self._register(layer, f"{projection}_weight_scale", (num_experts, rows, k // self.group), scale_dtype, dim)
            if self.global_name is not None:
                for name in (self.global_name, self.input_name):
                    shape = (num_experts, 2) if projection == "w13" else (num_experts,)
                    self._register(layer, f"{projection}_{name}", shape, torch.float32, None, projection == "w13")
        create_expert_biases(layer, num_experts, hidden_size, width, params_dtype)
        layer.fp4_in_features = {"w13": hidden_size, "w2": width}
        self.fused_moe = get_kernel("quantized_fused_moe", prefer="triton_fp4")

    @staticmethod
    def _register(layer, name, shape, dtype, feature_dim, per_shard=False) -> None:
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        attrs = {
            "weight_loader": layer.weight_loader,
            "moe_projection": name.split("_", 1)[0],
            "feature_dim": feature_dim,
        }
        set_weight_attrs(param, {**attrs, "per_shard": True} if per_shard else attrs)
        layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for projection in ("w13", "w2"):
            packed = getattr(layer, f"{projection}_{self.packed_name}").data
            scales = getattr(layer, f"{projection}_weight_scale").data
            if self.quant_type == "nvfp4":
                scales = scales.view(torch.uint8)
            else:
                scales = fold_scale_bias(scales, f"{layer.prefix}.{projection}")
            layer.register_buffer(f"fp4_{projection}", packed.contiguous())
            layer.register_buffer(f"fp4_{projection}_scales", scales.contiguous())
        if self.global_name is not None:
            w13_global = nvfp4_row_scale(getattr(layer, f"w13_{self.global_name}").data, self.convention)
            w2_global = nvfp4_row_scale(getattr(layer, f"w2_{self.global_name}").data, self.convention)
            layer.register_buffer("fp4_w1_global", w13_global[:, 0].contiguous())
            layer.register_buffer("fp4_w3_global", w13_global[:, 1].contiguous())
            layer.register_buffer("fp4_w2_global", w2_global.reshape(-1).contiguous())
        for name in [n for n, _ in layer.named_parameters(recurse=False) if n.startswith(("w13_", "w2_"))]:
            if not name.endswith("_bias"):
                delattr(layer, name)

    def packed_experts(self, layer: nn.Module) -> tuple[PackedExperts, PackedExperts, PackedExperts]:
        """``(gate, up, down)`` for ``quantized_fused_moe``: gate and up are row views of w13."""
        width = layer.intermediate_size_per_partition
        decode = dequantize_nvfp4_rows if self.quant_type == "nvfp4" else dequantize_mxfp4_rows
        nvfp4 = self.global_name is not None

        def packed(data: Tensor, scales: Tensor, shard: str) -> PackedExperts:
            in_features = layer.fp4_in_features["w2" if shard == "w2" else "w13"]
            global_scales = getattr(layer, f"fp4_{shard}_global") if nvfp4 else None
            return PackedExperts(data, scales, self.quant_type, in_features, decode, global_scales)

        data, scales = layer.fp4_w13, layer.fp4_w13_scales
        return (
            packed(data[:, :width], scales[:, :width], "w1"),
            packed(data[:, width:], scales[:, width:], "w3"),
            packed(layer.fp4_w2, layer.fp4_w2_scales, "w2"),
        )

    def dequantize(self, layer: nn.Module, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        dtype = dtype or layer.params_dtype
        every = torch.arange(layer.num_experts, device=layer.fp4_w13.device)
        gate, up, down = (p.experts(every, dtype) for p in self.packed_experts(layer))
        return torch.cat([gate, up], dim=1), down

    def apply(self, layer: nn.Module, hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        return self.fused_moe(hidden, *self.packed_experts(layer), topk_weights, topk_ids, layer.activation())
