"""fw: a plugin-based platform for serving local LLMs fast.

Plugin authors import :data:`hookimpl` from here. Model users import :class:`LLM`,
:class:`SamplingParams` and :class:`EngineBuilder` (loaded lazily, so ``import framework`` does
not import torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

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
