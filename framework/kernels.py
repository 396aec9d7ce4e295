"""The kernel registry's front door: ``get_kernel("rms_norm")`` returns the callable to use.

Layers resolve their kernels once, at construction, never per call. The choice for each op is
the available implementation with the highest priority on the detected platform;
``FW_KERNELS="rms_norm=torch,rotary_embedding=triton"`` forces named implementations (tests,
benchmarks, debugging).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from framework import plugins, registries
from framework.platform import detect_platform


def _forced() -> dict[str, str]:
    pairs = (item.split("=", 1) for item in os.environ.get("FW_KERNELS", "").split(",") if "=" in item)
    return {op.strip(): name.strip() for op, name in pairs}


@functools.cache
def _resolve(op: str, name: str | None, generation: int) -> Callable[..., Any]:
    platform = detect_platform()
    return registries.kernels(platform).select(op, platform, name).load()


def get_kernel(op: str, name: str | None = None) -> Callable[..., Any]:
    """The implementation of ``op``: ``name`` if given (or forced by ``FW_KERNELS``), else the best."""
    return _resolve(op, name or _forced().get(op), plugins.generation())
