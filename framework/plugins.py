"""Plugin discovery and calling: one pluggy ``PluginManager("fw")`` per process.

``load_plugins()`` is idempotent; every process (CLI, API server, engine core, workers) calls
it. Discovery reads the entry-point group ``fw``. Environment variables:

* ``FW_PLUGINS=a,b``: allow-list; only these entry-point plugins load.
* ``FW_DISABLE_PLUGINS=a,b``: block-list; these never load (the built-in ``core`` can be
  blocked too, for tests of a plugin in isolation).
* ``FW_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points at all (only ``core`` and plugins
  registered in code with :func:`register_plugin`).

A plugin that fails to import, or implements a hook that does not exist, is reported by name
(:func:`load_errors`, a warning on stderr) and left out; the others still load.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from framework import hookspecs
from framework.errors import PluginError

log = logging.getLogger("fw.plugins")

ENTRY_POINT_GROUP = "fw"
CORE_PLUGIN = "core"


@dataclass(slots=True)
class PluginInfo:
    """What ``fw plugins list`` shows about one loaded plugin."""

    name: str
    module: str
    distribution: str | None = None
    version: str | None = None
    hooks: list[str] = field(default_factory=list)


@dataclass(slots=True)
class PluginLoadError:
    """A plugin that was left out, and why."""

    name: str
    distribution: str | None
    error: str


@dataclass(slots=True)
class _State:
    manager: pluggy.PluginManager
    infos: dict[str, PluginInfo] = field(default_factory=dict)
    errors: list[PluginLoadError] = field(default_factory=list)
    generation: int = 0


_state: _State | None = None
_generations = itertools.count(1)  # never restarts, so caches keyed on it cannot go stale after a reset


def _env_names(var: str) -> set[str] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def load_plugins() -> pluggy.PluginManager:
    """Load the built-in core plugin and every allowed entry-point plugin, once per process."""
    global _state
    if _state is not None:
        return _state.manager
    manager = pluggy.PluginManager("fw")
    manager.add_hookspecs(hookspecs)
    _state = _State(manager, generation=next(_generations))
    allowed, blocked = _env_names("FW_PLUGINS"), _env_names("FW_DISABLE_PLUGINS") or set()
    if CORE_PLUGIN not in blocked:
        from framework import builtin

        _register(builtin, CORE_PLUGIN, distribution="fw")
    if os.environ.get("FW_DISABLE_PLUGIN_AUTOLOAD", "").lower() not in ("", "0", "false", "no"):
        return manager
    seen: set[str] = set()
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        name = entry_point.name
        if name in seen or name in blocked or (allowed is not None and name not in allowed):
            continue
        seen.add(name)
        dist = entry_point.dist.name if entry_point.dist else None
        try:
            module = entry_point.load()
        except Exception as exc:  # a broken plugin must not take the others down
            _record_error(name, dist, f"failed to import {entry_point.value}: {type(exc).__name__}: {exc}")
            continue
        _register(module, name, distribution=dist)
    return manager


def register_plugin(module_or_object: Any, name: str, distribution: str | None = None) -> None:
    """Register a plugin object in code (tests, embedding applications); validates its hooks."""
    load_plugins()
    _register(module_or_object, name, distribution)
    if name not in _require_state().infos:
        raise PluginError(_require_state().errors[-1].error)


def unregister_plugin(name: str) -> None:
    """Remove a plugin registered earlier (tests)."""
    state = _require_state()
    plugin = state.manager.get_plugin(name)
    if plugin is not None:
        state.manager.unregister(plugin)
    state.infos.pop(name, None)
    state.generation = next(_generations)


def reset_plugins() -> None:
    """Forget all plugins; the next :func:`load_plugins` discovers them again (tests)."""
    global _state
    _state = None


def _register(plugin: Any, name: str, distribution: str | None) -> None:
    state = _require_state()
    manager = state.manager
    try:
        manager.register(plugin, name=name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        _record_error(name, distribution, "invalid hook implementation: " + " ".join(str(exc).split()))
        return
    unknown = [
        impl.function.__name__
        for caller in manager.get_hookcallers(plugin) or []
        for impl in caller.get_hookimpls()
        if impl.plugin is plugin and caller.spec is None
    ]
    if unknown:
        manager.unregister(plugin)
        valid = ", ".join(hook_names())
        _record_error(
            name, distribution, f"implements unknown hook(s) {', '.join(sorted(set(unknown)))}; valid hooks: {valid}"
        )
        return
    version = None
    if distribution:
        try:
            version = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            version = None
    hooks = sorted(caller.name for caller in manager.get_hookcallers(plugin) or [])
    module_name = getattr(plugin, "__name__", type(plugin).__module__)
    state.infos[name] = PluginInfo(name, module_name, distribution, version, hooks)
    state.generation = next(_generations)


def _record_error(name: str, distribution: str | None, error: str) -> None:
    message = (
        f"plugin {name!r}" + (f" (distribution {distribution})" if distribution else "") + f" was not loaded: {error}"
    )
    log.warning(message)
    _require_state().errors.append(PluginLoadError(name, distribution, message))


def _require_state() -> _State:
    load_plugins()
    assert _state is not None
    return _state


def hook_names() -> list[str]:
    """The names of every hook in :mod:`framework.hookspecs`."""
    return sorted(name for name, obj in vars(hookspecs).items() if hasattr(obj, "fw_spec"))


def loaded_plugins() -> list[PluginInfo]:
    """Every loaded plugin, core first."""
    infos = _require_state().infos
    return sorted(infos.values(), key=lambda info: (info.name != CORE_PLUGIN, info.name))


def load_errors() -> list[PluginLoadError]:
    """Plugins that were left out during loading, with the reason."""
    return list(_require_state().errors)


def generation() -> int:
    """A counter that changes whenever the set of plugins changes (registry caches key on it)."""
    return _require_state().generation


def call_each(hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
    """Call every implementation of ``hook_name``; return ``(plugin name, result)`` pairs.

    Registries use this instead of ``pm.hook.X()`` so that each registered spec can be traced to
    the plugin that registered it. ``None`` results are dropped.
    """
    manager = load_plugins()
    caller = getattr(manager.hook, hook_name)
    results = []
    for impl in reversed(caller.get_hookimpls()):
        result = impl.function(**{arg: kwargs[arg] for arg in impl.argnames if arg in kwargs})
        if result is not None:
            results.append((impl.plugin_name, result))
    return results


def call_first(hook_name: str, **kwargs: Any) -> Any:
    """Call a ``firstresult`` hook; the first non-``None`` result (plugins before core defaults)."""
    return getattr(load_plugins().hook, hook_name)(**kwargs)


def call_all(hook_name: str, **kwargs: Any) -> list[Any]:
    """Call a hook on every plugin and return the non-``None`` results (lifecycle hooks)."""
    return getattr(load_plugins().hook, hook_name)(**kwargs)


async def call_lifecycle(hook_name: str, **kwargs: Any) -> None:
    """Call ``startup`` / ``shutdown`` on every plugin, awaiting the awaitables they return, in order."""
    for result in call_all(hook_name, **kwargs):
        if inspect.isawaitable(result):
            await result


def call_lifecycle_sync(hook_name: str, **kwargs: Any) -> None:
    """:func:`call_lifecycle` from code without an event loop (``LLM``): awaitables run to completion."""
    results = [result for result in call_all(hook_name, **kwargs) if inspect.isawaitable(result)]
    if results:

        async def wait_all() -> None:
            for result in results:
                await result

        asyncio.run(wait_all())
