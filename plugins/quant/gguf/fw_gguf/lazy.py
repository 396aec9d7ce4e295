"""GGUF tensors as lazy checkpoint slices: decoded only in the block a layer keeps, in its dtype.

MoE experts stacked per projection (``ffn_gate_exps [E, I, H]``, ...) load on the CPU into ``FusedMoE``'s
plain weights. Dequantizing a whole stack to fp32 first would take ~3.5x its packed size (8x for
4-bit types) on every tensor-parallel rank; as a :class:`GGUFTensorSlice` the stack is narrowed to
this rank's intermediate features by ``FusedMoE.weight_loader`` and decoded only there, straight
into the parameter's dtype (bf16, fp16 or fp32, as the engine was asked) and onto its device.
"""

from __future__ import annotations

import torch

from framework.loader.checkpoint_slice import CheckpointSlice

from .dequant import dequantize_slice
from .reader import TensorInfo


class GGUFTensorSlice(CheckpointSlice):
    """A GGUF tensor (a :class:`~fw_gguf.reader.TensorInfo`) read lazily: ``narrow`` selects,
    :meth:`materialize` dequantizes the selected values only."""

    def __init__(self, info: TensorInfo) -> None:
        super().__init__(info, info.shape)

    def materialize(self, like: torch.Tensor | None = None) -> torch.Tensor:
        """The selected values in ``like``'s dtype and on its device (fp32 on the CPU without ``like``)."""
        info: TensorInfo = self.source
        dtype, device = (torch.float32, None) if like is None else (like.dtype, like.device)
        return dequantize_slice(info.data, info.qtype, self.bounds, dtype, device)

    def __repr__(self) -> str:
        return f"GGUFTensorSlice({self.source.name}, {self.source.qtype.name}, bounds={self.bounds})"
