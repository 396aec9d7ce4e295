"""A checkpoint tensor that is read only in the part a tensor-parallel rank keeps.

Under tensor parallelism the safetensors format yields :class:`CheckpointSlice` objects instead
of tensors: the layers' weight loaders ``narrow`` them (as they would a tensor) and
:func:`materialize` reads just that block from the mmap'd file with ``get_slice``, so a rank
never holds a whole matrix it keeps a quarter of. A format whose tensors need decoding (GGUF's
quantized expert stacks) subclasses it: :meth:`CheckpointSlice.materialize` is told the
destination (``like``), so the block can be decoded straight into its dtype and onto its device.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


class CheckpointSlice:
    """``narrow`` / ``size`` / ``shape`` like a tensor; :meth:`materialize` reads the selected block."""

    def __init__(self, source: Any, shape: tuple[int, ...], bounds: tuple[tuple[int, int], ...] | None = None) -> None:
        self.source = source  # a safetensors PySafeSlice (or anything indexable by a tuple of slices)
        self.bounds = bounds or tuple((0, n) for n in shape)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(end - start for start, end in self.bounds)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.bounds)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointSlice:
        dim = dim % len(self.bounds)
        low, high = self.bounds[dim]
        if start < 0 or length < 0 or low + start + length > high:
            raise IndexError(f"narrow({dim}, {start}, {length}) out of range for shape {tuple(self.shape)}")
        bounds = list(self.bounds)
        bounds[dim] = (low + start, low + start + length)
        narrowed = copy.copy(self)  # a subclass stays itself
        narrowed.bounds = tuple(bounds)
        return narrowed

    def materialize(self, like: torch.Tensor | None = None) -> torch.Tensor:
        """The selected block, read now. ``like`` is the tensor it will be copied into: a source
        that decodes (a subclass) produces ``like``'s dtype and device; here it is not needed, the
        copy converts."""
        if not self.bounds:  # a scalar
            return self.source[...]
        return self.source[tuple(slice(start, end) for start, end in self.bounds)]


def materialize(tensor: Any, like: torch.Tensor | None = None) -> torch.Tensor:
    """``tensor`` itself, or the block a :class:`CheckpointSlice` selects, read now (in ``like``'s
    dtype and on its device where the slice decodes; see :meth:`CheckpointSlice.materialize`)."""
    return tensor.materialize(like) if isinstance(tensor, CheckpointSlice) else tensor
