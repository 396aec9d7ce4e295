"""The cheap, declarative specs that plugins return from ``register_*`` hooks.

A spec names a capability, states what it needs (devices, packages, compute capability) and
points at its implementation with a lazy ``"module:attr"`` reference. Building a spec must not
import torch or any heavy dependency: the implementation is imported by :meth:`Spec.load` only
when the capability is selected.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from framework.platform import Platform


@dataclass(frozen=True, slots=True, kw_only=True)
class Spec:
    """Fields every spec shares.

    ``name`` is the registry key users type (``--attention-backend triton``). ``impl`` is a
    ``"package.module:attribute"`` reference resolved by :meth:`load`. ``priority`` orders
    candidates where several can serve (higher wins). ``devices``, ``requires`` (importable
    package names) and ``min_compute_capability`` are checked by :meth:`unavailable_reasons`.
    """

    name: str
    impl: str = ""
    description: str = ""
    priority: int = 0
    devices: tuple[str, ...] = ("cpu", "cuda")
    requires: tuple[str, ...] = ()
    min_compute_capability: tuple[int, int] | None = None

    @property
    def key(self) -> str:
        """The registry key; unique within one registry."""
        return self.name

    def load(self) -> Any:
        """Import and return the implementation named by ``impl``."""
        if not self.impl or ":" not in self.impl:
            raise ValueError(f"{type(self).__name__} {self.key!r} has no 'module:attr' impl: {self.impl!r}")
        module_name, _, attr = self.impl.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj

    def unavailable_reasons(self, platform: Platform) -> list[str]:
        """Why this capability cannot run on ``platform``; an empty list means it can."""
        reasons = []
        if platform.device_type not in self.devices:
            reasons.append(f"needs device {' or '.join(self.devices)}, this machine has {platform.device_type}")
        for package in self.requires:
            if not platform.has_package(package):
                reasons.append(f"package {package!r} is not installed")
        cc, need = platform.compute_capability, self.min_compute_capability
        if need and platform.is_cuda and cc is not None and cc < need:
            reasons.append(f"needs compute capability >= {need[0]}.{need[1]}, device has {cc[0]}.{cc[1]}")
        return reasons


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec(Spec):
    """A model architecture: ``name`` is the Hugging Face ``architectures[0]`` string.

    ``impl`` is a class taking ``(config, quant_config, prefix)`` (DESIGN §4).
    ``kv_cache_layout`` names the KV layout its attention needs (``"standard"`` K/V per head,
    ``"mla"`` compressed latent); ``supports_tensor_parallel`` says whether it can be sharded.
    ``config_defaults`` are ``(key, value)`` pairs the architecture's reference config class
    assumes when a checkpoint's ``config.json`` omits them (multimodal checkpoints such as Gemma 3
    4B keep a sparse ``text_config``): the engine fills them in before it reads the config, into
    ``text_config`` where there is one (:func:`framework.engine.model_loading.with_config_defaults`).
    """

    kv_cache_layout: str = "standard"
    supports_tensor_parallel: bool = False
    config_defaults: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightFormatSpec(Spec):
    """A weight format (safetensors, gguf): ``impl`` is a :class:`framework.loader.WeightFormat`.

    Formats are tried in ``priority`` order to detect a model source.
    """


@dataclass(frozen=True, slots=True, kw_only=True)
class QuantMethodSpec(Spec):
    """A quantization method: ``impl`` is its ``QuantConfig`` class (which makes LinearMethods).

    ``isq_types`` are the ``--isq`` names (in-situ quantization of a 16-bit checkpoint at load)
    this method offers; its ``QuantConfig`` then implements ``for_isq`` and ``quantize_weight``
    (see :mod:`framework.isq`). Each name belongs to one method.
    """

    isq_types: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCacheDtypeSpec(Spec):
    """A KV-cache storage type (:mod:`framework.kv_cache`): the row format of keys and of values
    (``model``: the model dtype; ``fp8``, ``int4``, ``int3``), whether keys / values are rotated first, and
    the ``bits`` per element on average (for listings). ``backends``: informational, the backends
    known to read it (each backend's own ``kv_cache_dtypes`` decides)."""

    bits: float = 16
    backends: tuple[str, ...] = ()
    key_format: str = "model"
    value_format: str = "model"
    rotate_keys: bool = False
    rotate_values: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionBackendSpec(Spec):
    """An attention backend: ``impl`` is its backend class.

    ``kv_cache_layouts`` and ``kv_cache_dtypes`` list what it can read; ``model_dtypes`` the
    model dtypes it computes in (empty = any); the class's ``validate(...)`` may add
    model-specific reasons (head size, soft-cap) at selection time.
    """

    kv_cache_layouts: tuple[str, ...] = ("standard",)
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    model_dtypes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelSpec(Spec):
    """One implementation of the op ``op`` (``rms_norm``, ``rotary_embedding``, ...).

    Several implementations of one op coexist; the registry picks the available one with the
    highest ``priority``. Its key is ``"op/name"``.
    """

    op: str

    @property
    def key(self) -> str:
        return f"{self.op}/{self.name}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParserSpec(Spec):
    """A per-request incremental output parser; ``kind`` is ``"tool"`` or ``"reasoning"``."""

    kind: str = "tool"
