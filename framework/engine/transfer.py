"""Host <-> device copies that never make the host wait for the device.

A copy from pageable host memory, or one with ``non_blocking=False``, synchronises the CUDA
stream: in a step launched while the previous one still runs (async scheduling) it would wait
for that step and undo the overlap. Inputs therefore go through pinned memory without blocking,
and results come back into pinned memory behind an event the host waits on only when it reads::

    host lists ──torch.tensor──► pageable ──pin_memory──► pinned ──non_blocking──► device
    device ──non_blocking──► pinned (HostCopy) ── event.synchronize() at read time ──► lists

On the CPU both are plain tensors; nothing is copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``, without synchronising a CUDA stream."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors copied to the host on the current stream; :meth:`wait` before reading them.

    ``None`` entries stay ``None``. The copies are queued behind whatever the stream already holds
    (the step that computed them), so waiting does not wait for work queued after the copy.
    """

    def __init__(self, tensors: Sequence[torch.Tensor | None]) -> None:
        self.event: torch.cuda.Event | None = None
        self.tensors: list[torch.Tensor | None] = []
        for tensor in tensors:
            if tensor is not None and tensor.is_cuda:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                tensor = host
                self.event = self.event or torch.cuda.Event()
            self.tensors.append(tensor)
        if self.event is not None:
            self.event.record()

    def wait(self) -> list[torch.Tensor | None]:
        """The host tensors, once their copies have finished."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensors
