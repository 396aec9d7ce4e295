"""The typed facade over the ``register_*`` hooks: core code asks here, never ``pm.hook``.

Each function builds its registry once per plugin generation (and platform) from every
plugin's specs, so adding or removing a plugin in a test is seen at the next call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from framework import plugins
from framework.errors import PluginError
from framework.platform import Platform, detect_platform
from framework.registry import KernelRegistry, Registry
from framework.specs import (
    AttentionBackendSpec,
    KernelSpec,
    KVCacheDtypeSpec,
    ModelSpec,
    ParserSpec,
    QuantMethodSpec,
    Spec,
    WeightFormatSpec,
)

R = TypeVar("R", bound=Registry)

#: hook name -> (registry kind shown in messages, spec class, whether the hook takes the platform)
REGISTRY_HOOKS: dict[str, tuple[str, type[Spec], bool]] = {
    "register_model_architectures": ("model architecture", ModelSpec, True),
    "register_weight_formats": ("weight format", WeightFormatSpec, False),
    "register_quantization_methods": ("quantization method", QuantMethodSpec, False),
    "register_kv_cache_dtypes": ("KV-cache dtype", KVCacheDtypeSpec, False),
    "register_attention_backends": ("attention backend", AttentionBackendSpec, True),
    "register_kernels": ("kernel", KernelSpec, True),
    "register_tool_parsers": ("tool parser", ParserSpec, False),
    "register_reasoning_parsers": ("reasoning parser", ParserSpec, False),
}


def _fill(registry: R, hook_name: str, platform: Platform) -> R:
    _, spec_type, _ = REGISTRY_HOOKS[hook_name]
    for plugin_name, specs in plugins.call_each(hook_name, platform=platform):
        for spec in specs:
            if not isinstance(spec, spec_type):
                raise PluginError(
                    f"plugin {plugin_name!r}: {hook_name} must return {spec_type.__name__} objects, got {type(spec).__name__}"
                )
            registry.add(spec, plugin_name)
    return registry


@functools.cache
def _build(hook_name: str, platform: Platform, generation: int) -> Registry:
    kind = REGISTRY_HOOKS[hook_name][0]
    registry = KernelRegistry() if hook_name == "register_kernels" else Registry(kind)
    return _fill(registry, hook_name, platform)


def registry_for(hook_name: str, platform: Platform | None = None) -> Registry:
    """The merged registry of one ``register_*`` hook."""
    platform = platform or detect_platform(probe_device=False)
    return _build(hook_name, platform, plugins.generation())


def _typed(hook_name: str) -> Callable[..., Any]:
    def get(platform: Platform | None = None) -> Registry:
        return registry_for(hook_name, platform)

    get.__doc__ = f"The registry filled by every plugin's ``{hook_name}``."
    return get


model_architectures: Callable[..., Registry[ModelSpec]] = _typed("register_model_architectures")
weight_formats: Callable[..., Registry[WeightFormatSpec]] = _typed("register_weight_formats")
quantization_methods: Callable[..., Registry[QuantMethodSpec]] = _typed("register_quantization_methods")
kv_cache_dtypes: Callable[..., Registry[KVCacheDtypeSpec]] = _typed("register_kv_cache_dtypes")
attention_backends: Callable[..., Registry[AttentionBackendSpec]] = _typed("register_attention_backends")
kernels: Callable[..., KernelRegistry] = _typed("register_kernels")
tool_parsers: Callable[..., Registry[ParserSpec]] = _typed("register_tool_parsers")
reasoning_parsers: Callable[..., Registry[ParserSpec]] = _typed("register_reasoning_parsers")
