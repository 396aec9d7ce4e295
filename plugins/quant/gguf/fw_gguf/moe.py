"""GGUF mixture-of-experts stacks kept packed: :class:`GGUFFusedMoEMethod`.

llama.cpp stores a layer's experts as one tensor per projection, ``ffn_gate_exps`` /
``ffn_up_exps`` ``[E, I, H]`` and ``ffn_down_exps`` ``[E, H, I]``, each with its own ggml type
(Q4_K_M files keep the down stack in Q6_K). The method keeps each stack's bytes,
``[E, rows, bytes_per_row]`` uint8, and runs the kernel registry's ``quantized_fused_moe`` op on
them: on CUDA fw_gguf's own Triton kernels (:mod:`fw_gguf.kernels.moe`, asked for by name), for
which each expert's matrix is regrouped after loading into the planar layout (same bytes, same
size; ``layer.gguf_planar``); elsewhere the torch reference, which gathers and dequantizes only
the chosen experts for a few tokens and loops over the experts hit for many::

    gguf_w1  [E, I/tp, bytes(gate type, H)]     rows: this rank's intermediate features
    gguf_w3  [E, I/tp, bytes(up type, H)]
    gguf_w2  [E, H, bytes(down type, I/tp)]     bytes: this rank's whole blocks of each row

On the CPU, where dequantizing per step costs more than the matmul, the stacks are not kept
packed (:func:`gguf_moe_method` returns None: FusedMoE's plain weights take them, dequantized
lazily at load, only this rank's features), unless ``FW_GGUF_KEEP_PACKED=1``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import gguf
import torch
from gguf import GGMLQuantizationType
from torch import nn

from framework.errors import ConfigError, ModelLoadError
from framework.kernels import get_kernel, target_device
from framework.layers.linear import set_weight_attrs
from framework.ops import PackedExperts
from framework.quantization import FusedMoEMethod

from .dequant import as_quant_type, bytes_per_row, dequantize
from .kernels.layout import KERNEL_TYPES, experts_from_planar, experts_to_planar
from .lazy import GGUFTensorSlice

#: FusedMoE shard -> the checkpoint projection whose stack fills it.
EXPERT_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_FLOAT_TYPES = ("F32", "F16", "BF16")


def keep_packed_on_cpu() -> bool:
    """``FW_GGUF_KEEP_PACKED=1``: the CPU keeps GGUF weights packed too (the GPU's path, for tests)."""
    return os.environ.get("FW_GGUF_KEEP_PACKED", "") not in ("", "0")


def gguf_moe_method(tensor_types: dict[str, str], layer: nn.Module, prefix: str) -> FusedMoEMethod | None:
    """The packed method for the FusedMoE ``layer`` at ``prefix`` when the file holds its three stacks
    in quantized types and the layer will run where packed experts pay (not the CPU, unless
    ``FW_GGUF_KEEP_PACKED=1``); None otherwise (plain weights, dequantized at load). gpt-oss's
    biased, clamped experts in MXFP4 take fw_fp4's MXFP4 method on every device
    (:func:`fw_gguf.gpt_oss.mxfp4_moe_method`)."""
    if layer.has_bias or layer.swiglu_limit is not None:  # gpt-oss: its MXFP4 stacks run on fw_fp4's method
        from .gpt_oss import mxfp4_moe_method

        return mxfp4_moe_method(tensor_types, prefix)
    names = {shard: f"{prefix}.{projection}.weight" for shard, projection in EXPERT_PROJECTIONS.items()}
    if any(name not in tensor_types or tensor_types[name] in _FLOAT_TYPES for name in names.values()):
        return None
    device = target_device() or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cpu" and not keep_packed_on_cpu():
        return None
    return GGUFFusedMoEMethod({shard: tensor_types[name] for shard, name in names.items()})


#: The ``quantized_fused_moe`` implementation made for these stacks (fw_gguf.kernels.moe), where it runs.
KERNEL_NAME = "triton_gguf"


def _dequantize_experts(
    qtype: GGMLQuantizationType,
    in_features: int,
    planar: bool,
    data: torch.Tensor,
    scales: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[n, rows, bytes]`` packed expert rows (each expert planar where ``planar``) -> ``[n, rows,
    in_features]`` values (GGUF blocks hold their scales)."""
    num, rows = data.shape[0], data.shape[1]
    if planar:
        data = experts_from_planar(data, qtype)
    return dequantize(data, qtype, (num * rows, in_features), dtype).view(num, rows, in_features)


class GGUFFusedMoEMethod(FusedMoEMethod):
    """A FusedMoE's three GGUF expert stacks, packed; ``w13_weight`` / ``w2_weight`` are empty
    placeholders whose loader copies the stacks' bytes into ``gguf_w1`` / ``gguf_w3`` / ``gguf_w2``.
    SwiGLU or GeGLU experts (Gemma 4), without biases (:func:`gguf_moe_method` leaves those plain)."""

    supports_moe_activation = True
    supported_act_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    supported_device_types = frozenset({"cpu", "cuda"})

    def __init__(self, types: dict[str, str]) -> None:
        self.types = {shard: as_quant_type(GGMLQuantizationType[name]) for shard, name in types.items()}

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
    ) -> None:
        width = intermediate_size_per_partition
        down_block = gguf.GGML_QUANT_SIZES[self.types["w2"]][0]
        if width % down_block:
            raise ConfigError(
                f"{layer.prefix}: {width} intermediate features per rank are not a whole number of "
                f"{self.types['w2'].name} blocks of {down_block} (the packed down_proj experts are split "
                f"by blocks); use a smaller tensor-parallel size"
            )
        shapes = {"w1": (width, hidden_size), "w3": (width, hidden_size), "w2": (hidden_size, width)}
        for shard, (rows, cols) in shapes.items():
            packed = torch.empty(num_experts, rows, bytes_per_row(self.types[shard], cols), dtype=torch.uint8)
            layer.register_buffer(f"gguf_{shard}", packed)
        layer.gguf_in_features = {shard: cols for shard, (_, cols) in shapes.items()}
        loader = functools.partial(self.load_weight, layer)
        loader.reads_checkpoint_slices = True  # it reads a GGUFTensorSlice's bytes, never its dequantized values
        for name, projection in (("w13_weight", "w13"), ("w2_weight", "w2")):
            placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            set_weight_attrs(placeholder, {"weight_loader": loader, "moe_projection": projection})
            layer.register_parameter(name, placeholder)
        layer.gguf_planar = False
        self.fused_moe = get_kernel("quantized_fused_moe", prefer=KERNEL_NAME)
        self.dense_fused_moe = get_kernel("fused_moe")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """On CUDA, with every stack of a kernel type, regroup each expert's matrix into the planar
        layout the kernels read with 16-byte loads (:func:`fw_gguf.kernels.layout.experts_to_planar`)."""
        if layer.gguf_w1.device.type != "cuda" or not all(t in KERNEL_TYPES for t in self.types.values()):
            return
        for shard, qtype in self.types.items():
            setattr(layer, f"gguf_{shard}", experts_to_planar(getattr(layer, f"gguf_{shard}"), qtype))
        layer.gguf_planar = True

    def load_weight(
        self, layer: nn.Module, param: nn.Parameter, loaded: Any, shard_id: str, expert_id: int | None = None
    ) -> None:
        """Copy this rank's part of a checkpoint expert stack's packed bytes (a ``GGUFTensorSlice``
        or a uint8 ``[E, rows, bytes]`` tensor; one expert's ``[rows, bytes]`` with ``expert_id``)."""
        layer.check_expert_shard(param, shard_id, expert_id)
        if shard_id == "w13":
            raise ModelLoadError(
                f"{layer.prefix}: GGUF keeps gate and up experts in separate tensors; got a fused gate_up"
            )
        packed = self._packed_bytes(layer, loaded, shard_id)
        width = layer.intermediate_size_per_partition
        if shard_id == "w2":  # whole blocks of every row: this rank's columns
            row_bytes = bytes_per_row(self.types["w2"], width)
            packed = packed.narrow(-1, layer.tp_rank * row_bytes, row_bytes) if layer.tp_size > 1 else packed
        elif layer.tp_size > 1:
            packed = packed.narrow(-2, layer.tp_rank * width, width)
        target = getattr(layer, f"gguf_{shard_id}")
        target = target if expert_id is None else target[expert_id]
        if packed.shape != target.shape:
            raise ModelLoadError(
                f"{layer.prefix} {EXPERT_PROJECTIONS[shard_id]}: expected packed {self.types[shard_id].name} "
                f"experts of this rank {tuple(target.shape)}, got {tuple(packed.shape)}"
            )
        target.copy_(packed)
        layer.record_loaded(shard_id, expert_id)

    def _packed_bytes(self, layer: nn.Module, loaded: Any, shard_id: str) -> torch.Tensor:
        """The uint8 bytes behind ``loaded``, refusing a tensor of another type or narrowed within rows."""
        qtype = self.types[shard_id]
        if isinstance(loaded, GGUFTensorSlice):  # whole rows of the stack (Gemma 4: half a gate_up stack)
            info = loaded.source
            if as_quant_type(info.qtype) != qtype or loaded.bounds[-1] != (0, info.shape[-1]):
                raise ModelLoadError(
                    f"{layer.prefix}: {info.name} is {info.qtype.name} {tuple(loaded.shape)}; expected "
                    f"whole {qtype.name} rows of every expert"
                )
            data = info.data
            for dim, (start, end) in enumerate(loaded.bounds[:-1]):
                data = data.narrow(dim, start, end - start)
            return data
        if not isinstance(loaded, torch.Tensor) or loaded.dtype != torch.uint8:
            raise ModelLoadError(
                f"{layer.prefix} {EXPERT_PROJECTIONS[shard_id]}: expected packed {qtype.name} bytes, "
                f"got {getattr(loaded, 'dtype', type(loaded).__name__)}"
            )
        return loaded

    def packed_experts(self, layer: nn.Module) -> tuple[PackedExperts, PackedExperts, PackedExperts]:
        """``(gate, up, down)`` as the ``quantized_fused_moe`` op takes them."""

        def packed(shard: str) -> PackedExperts:
            qtype, in_features, planar = self.types[shard], layer.gguf_in_features[shard], layer.gguf_planar
            return PackedExperts(
                getattr(layer, f"gguf_{shard}"),
                None,
                f"{'gguf-planar' if planar else 'gguf'}:{qtype.name}",
                in_features,
                functools.partial(_dequantize_experts, qtype, in_features, planar),
            )

        return packed("w1"), packed("w3"), packed("w2")

    def dequantize(self, layer: nn.Module, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = dtype or layer.params_dtype
        gate, up, down = (p.dequantize(p.data, p.scales, dtype) for p in self.packed_experts(layer))
        return torch.cat([gate, up], dim=1), down

    def apply(
        self, layer: nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        packed = self.packed_experts(layer)
        activation = () if layer.is_plain_swiglu else (layer.activation(),)  # GeGLU: Gemma 4
        in_kernels = all(p.quant_type in getattr(self.fused_moe, "quant_types", ()) for p in packed)
        if (
            not in_kernels
            and topk_ids.numel() > layer.num_experts
            and hidden.is_cuda
            and torch.cuda.is_current_stream_capturing()
        ):
            # many tokens inside a CUDA graph without the Triton kernels: the reference's per-expert
            # loop would sync; every expert dequantized once, then the dense kernel (graph-safe)
            w13, w2 = self.dequantize(layer, hidden.dtype)
            return self.dense_fused_moe(hidden, w13, w2, topk_weights, topk_ids, *activation)
        return self.fused_moe(hidden, *packed, topk_weights, topk_ids, *activation)
