"""fw: a plugin-based platform for serving local LLMs fast.

Plugin authors import :data:`hookimpl` from here. Model users import :class:`LLM`,
:class:`SamplingParams` and :class:`EngineBuilder` (loaded lazily, so ``import framework`` does
not import torch).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import pluggy


def _prefer_passive_openmp() -> None:
    """Make OpenMP threads sleep, not spin, between parallel regions, unless the user chose.

    A CPU decode step runs hundreds of short parallel regions (torch's ops and the GGUF CPU
    kernels share one libgomp pool); by default its threads spin-wait between them, taking the
    cores that other processes (``fw serve``'s API process, anything else on a small machine)
    need. Measured on a shared 2-core machine (SmolLM2 Q4_1, 16 tokens): 0.46 tok/s spinning,
    5.2 with ``OMP_WAIT_POLICY=PASSIVE``. It only takes effect before torch loads libgomp, so it
    runs when ``framework`` is imported first (the ``fw`` command always does); spawned engine
    and worker processes inherit it. ``OMP_WAIT_POLICY=ACTIVE`` (or ``GOMP_SPINCOUNT``) restores spinning.
    """
    if "torch" in sys.modules or {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


_prefer_passive_openmp()

__version__ = "0.1.0"

#: Marker for hook implementations in plugins: ``@hookimpl def register_kernels(): ...``
hookimpl = pluggy.HookimplMarker("fw")

_LAZY = {
    "LLM": "framework.llm:LLM",
    "SamplingParams": "framework.sampling_params:SamplingParams",
    "StructuredOutputsParams": "framework.sampling_params:StructuredOutputsParams",
    "EngineBuilder": "framework.engine.builder:EngineBuilder",
    "EngineArgs": "framework.engine.args:EngineArgs",
}

if TYPE_CHECKING:
    from framework.engine.args import EngineArgs
    from framework.engine.builder import EngineBuilder
    from framework.llm import LLM
    from framework.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["hookimpl", "LLM", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "EngineBuilder", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, _, attr = _LAZY[name].partition(":")
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'framework' has no attribute {name!r}")
