"""``Mxfp4FusedMoEMethod``: a FusedMoE's experts kept in MXFP4 (:mod:`fw_fp4.formats`) and multiplied as W4A16.

Parameters (the checkpoint's, gate/up rows already de-interleaved by the model, see
``fw_llama.gpt_oss``), per rank ``I`` intermediate features::

    w13_blocks uint8 [E, 2I, H/32, 16]   w13_scales uint8 [E, 2I, H/32]     (gate rows, then up rows)
    w2_blocks  uint8 [E, H, I/32, 16]    w2_scales  uint8 [E, H, I/32]
    w13_bias [E, 2I], w2_bias [E, H]     (params dtype, with FusedMoE(bias=True))

After loading the scales are rebased for the bit-manipulation decode (:func:`fold_scale_bias`)
and the blocks flattened to rows of ``K/2`` bytes (``[E, rows, K/2]``: each output row one
contiguous stream). ``apply`` runs the kernel registry's ``quantized_fused_moe`` op with
:class:`~framework.ops.PackedExperts` of type ``"mxfp4"``: ``fw_fp4``'s Triton kernel on CUDA,
the torch reference elsewhere (it decodes only the chosen experts for few tokens).
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
from .formats import MXFP4_BLOCK, MXFP4_BLOCK_BYTES, check_mxfp4_tensors, dequantize_mxfp4, fold_scale_bias

#: ``PackedExperts.quant_type`` of these experts: rows of K/2 bytes, rebased e8m0 scales per 32.
QUANT_TYPE = "mxfp4"


def dequantize_rows(data: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """``[n, rows, K/2]`` bytes and ``[n, rows, K/32]`` rebased scales -> ``[n, rows, K]`` (``PackedExperts.dequantize``)."""
    return dequantize_mxfp4(data.unflatten(-1, (-1, MXFP4_BLOCK_BYTES)), scales, dtype)


class Mxfp4FusedMoEMethod(FusedMoEMethod):
    """MXFP4 experts with optional biases and gpt-oss's clamped SwiGLU; see the module docstring."""

    supported_act_dtypes = ACT_DTYPES
    supported_device_types = frozenset({"cpu", "cuda"})
    supports_moe_activation = True

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
            if features % MXFP4_BLOCK:
                raise ConfigError(
                    f"{layer.prefix}: the {name} {features} is not a multiple of MXFP4's block of {MXFP4_BLOCK} "
                    "(with tensor parallelism: use a size that leaves each rank whole blocks)"
                )
        shapes = {"w13": (2 * width, hidden_size), "w2": (hidden_size, width)}
        # the dimension along which the intermediate features run: rows of w13, blocks of w2
        feature_dims = {("w13", "blocks"): -3, ("w13", "scales"): -2, ("w2", "blocks"): -2, ("w2", "scales"): -1}
        for projection, (rows, k) in shapes.items():
            for part, shape in (
                ("blocks", (rows, k // MXFP4_BLOCK, MXFP4_BLOCK_BYTES)),
                ("scales", (rows, k // MXFP4_BLOCK)),
            ):
                param = nn.Parameter(torch.empty(num_experts, *shape, dtype=torch.uint8), requires_grad=False)
                attrs = {
                    "weight_loader": layer.weight_loader,
                    "moe_projection": projection,
                    "feature_dim": feature_dims[(projection, part)],
                }
                set_weight_attrs(param, attrs)
                layer.register_parameter(f"{projection}_{part}", param)
        create_expert_biases(layer, num_experts, hidden_size, width, params_dtype)
        layer.mxfp4_in_features = {"w13": hidden_size, "w2": width}
        self.fused_moe = get_kernel("quantized_fused_moe", prefer="triton_fp4")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for projection in ("w13", "w2"):
            blocks, scales = getattr(layer, f"{projection}_blocks"), getattr(layer, f"{projection}_scales")
            where = f"{layer.prefix}.{projection}"
            check_mxfp4_tensors(blocks.data, scales.data, where)
            rows = blocks.data.flatten(-2)  # [E, rows, K/2]: one contiguous stream per output row
            delattr(layer, f"{projection}_blocks")
            delattr(layer, f"{projection}_scales")
            layer.register_buffer(f"mxfp4_{projection}", rows.contiguous())
            layer.register_buffer(f"mxfp4_{projection}_scales", fold_scale_bias(scales.data, where).contiguous())

    def packed_experts(self, layer: nn.Module) -> tuple[PackedExperts, PackedExperts, PackedExperts]:
        """``(gate, up, down)`` for ``quantized_fused_moe``: gate and up are row views of w13."""
        width = layer.intermediate_size_per_partition
        data, scales = layer.mxfp4_w13, layer.mxfp4_w13_scales
        hidden = layer.mxfp4_in_features["w13"]

        def packed(rows: Tensor, row_scales: Tensor, in_features: int) -> PackedExperts:
            return PackedExperts(rows, row_scales, QUANT_TYPE, in_features, dequantize_rows)

        return (
            packed(data[:, :width], scales[:, :width], hidden),
            packed(data[:, width:], scales[:, width:], hidden),
            packed(layer.mxfp4_w2, layer.mxfp4_w2_scales, layer.mxfp4_in_features["w2"]),
        )

    def dequantize(self, layer: nn.Module, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        dtype = dtype or layer.params_dtype
        w13 = dequantize_rows(layer.mxfp4_w13, layer.mxfp4_w13_scales, dtype)
        return w13, dequantize_rows(layer.mxfp4_w2, layer.mxfp4_w2_scales, dtype)

    def apply(self, layer: nn.Module, hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        return self.fused_moe(hidden, *self.packed_experts(layer), topk_weights, topk_ids, layer.activation())
