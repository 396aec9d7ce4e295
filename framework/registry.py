"""One typed registry style for every kind of spec (models, formats, backends, kernels, ...).

A :class:`Registry` maps a spec's key to the spec and remembers which plugin registered it.
Registering a key twice is an error naming both plugins; looking up an unknown key is an error
listing the valid keys.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

from framework.errors import DuplicateNameError, UnknownNameError
from framework.specs import KernelSpec, Spec

if TYPE_CHECKING:
    from framework.platform import Platform

S = TypeVar("S", bound=Spec)


class Registry(Generic[S]):
    """Specs of one kind, keyed by ``spec.key``; ``kind`` names the kind in error messages."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._specs: dict[str, S] = {}
        self._owners: dict[str, str] = {}

    def add(self, spec: S, plugin: str) -> None:
        """Register ``spec`` on behalf of ``plugin``; a key seen before raises DuplicateNameError."""
        if spec.key in self._specs:
            raise DuplicateNameError(
                f"{self.kind} {spec.key!r} is registered by both plugin {self._owners[spec.key]!r} "
                f"and plugin {plugin!r}; uninstall or disable one (FW_DISABLE_PLUGINS)"
            )
        self._specs[spec.key] = spec
        self._owners[spec.key] = plugin

    def get(self, key: str) -> S:
        """The spec under ``key``; an unknown key raises UnknownNameError listing valid keys."""
        try:
            return self._specs[key]
        except KeyError:
            valid = ", ".join(sorted(self._specs)) or "(none registered)"
            raise UnknownNameError(f"unknown {self.kind} {key!r}; valid: {valid}") from None

    def plugin_of(self, key: str) -> str:
        """The name of the plugin that registered ``key``."""
        self.get(key)
        return self._owners[key]

    def names(self) -> list[str]:
        return sorted(self._specs)

    def __contains__(self, key: object) -> bool:
        return key in self._specs

    def __iter__(self) -> Iterator[S]:
        return iter(sorted(self._specs.values(), key=lambda s: (-s.priority, s.key)))

    def __len__(self) -> int:
        return len(self._specs)

    def unavailable(self, platform: Platform) -> dict[str, list[str]]:
        """For every spec that cannot run on ``platform``, the reasons why."""
        reasons = {spec.key: spec.unavailable_reasons(platform) for spec in self}
        return {key: why for key, why in reasons.items() if why}

    def available(self, platform: Platform) -> list[S]:
        """Specs that can run on ``platform``, highest priority first."""
        return [spec for spec in self if not spec.unavailable_reasons(platform)]


class KernelRegistry(Registry[KernelSpec]):
    """Kernel implementations keyed ``"op/name"``; :meth:`select` picks one per op."""

    def __init__(self) -> None:
        super().__init__("kernel")

    def ops(self) -> list[str]:
        return sorted({spec.op for spec in self})

    def select(self, op: str, platform: Platform, name: str | None = None) -> KernelSpec:
        """The implementation of ``op`` to use: ``name`` if given, else the best available one."""
        if name is not None:
            return self.get(f"{op}/{name}")
        candidates = [spec for spec in self.available(platform) if spec.op == op]
        if not candidates:
            known = [spec.key for spec in self if spec.op == op]
            if not known:
                raise UnknownNameError(f"unknown kernel op {op!r}; valid: {', '.join(self.ops())}")
            raise UnknownNameError(
                f"no implementation of kernel op {op!r} can run on this machine: {self.unavailable(platform)}"
            )
        return candidates[0]
