"""The kernel registry's front door: ``get_kernel("rms_norm")`` returns the callable to use.

Layers resolve their kernels once, at construction, never per call. The choice for each op is
the available implementation with the highest priority on the platform of the device the
layers are built for (:func:`kernels_for`; this machine's default device outside it);
``FW_KERNELS="rms_norm=torch,rotary_embedding=triton"`` forces named implementations (tests,
benchmarks, debugging).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from framework import plugins, registries
from framework.platform import platform_for_device
from framework.specs import KernelSpec

#: The device ("cpu", "cuda:1", ...) the layers being built will run on; None: the machine's default.
_target_device: ContextVar[str | None] = ContextVar("fw_kernel_target_device", default=None)


@contextlib.contextmanager
def kernels_for(device: torch.device | str) -> Iterator[None]:
    """Layers built inside this block choose the kernels of ``device``'s platform: a model built
    for the CPU on a CUDA machine gets the torch ops, not Triton's."""
    token = _target_device.set(str(device))
    try:
        yield
    finally:
        _target_device.reset(token)


def target_device() -> str | None:
    """The device set by the enclosing :func:`kernels_for`, or None."""
    return _target_device.get()


def _forced() -> dict[str, str]:
    pairs = (item.split("=", 1) for item in os.environ.get("FW_KERNELS", "").split(",") if "=" in item)
    return {op.strip(): name.strip() for op, name in pairs}


def _select(op: str, name: str | None, device_type: str | None) -> KernelSpec:
    """The spec of ``op``'s implementation on ``device_type``'s platform: ``name``, else the best
    available one. Not cached: :func:`_resolve` caches what it loads."""
    platform = platform_for_device(device_type)
    return registries.kernels(platform).select(op, platform, name)


@functools.cache
def _resolve(op: str, name: str | None, generation: int, device_type: str | None) -> Callable[..., Any]:
    """The loaded implementation that :func:`_select` picks, once per plugin ``generation``."""
    return _select(op, name, device_type).load()


def get_kernel(op: str, name: str | None = None, *, prefer: str | None = None) -> Callable[..., Any]:
    """The implementation of ``op``: ``name`` if given (or forced by ``FW_KERNELS``), else the best.

    ``prefer`` names the implementation made for the caller's data (a quantization method's own
    kernel of a shared op such as ``quantized_fused_moe``, whose implementations each decode some
    formats): it is used where it is registered and can run on the target platform, ahead of a
    higher-priority one for another format; otherwise the best is. ``FW_KERNELS`` still wins.
    """
    device = _target_device.get()
    device_type = device and torch.device(device).type
    chosen = name or _forced().get(op)
    if chosen is None and prefer is not None:
        platform = platform_for_device(device_type)
        registry = registries.kernels(platform)
        key = f"{op}/{prefer}"
        if key in registry and not registry.get(key).unavailable_reasons(platform):
            chosen = prefer
    return _resolve(op, chosen, plugins.generation(), device_type)
