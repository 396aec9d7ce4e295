"""What this machine can run: device type, compute capability, optional packages.

The probe is cheap by default: ``detect_platform(probe_device=False)`` answers from the
filesystem and ``importlib.util.find_spec`` without importing torch, so ``fw --help`` and
``fw plugins list`` stay fast. Everything that is about to run a model calls
``detect_platform()`` (the default ``probe_device=True``), which asks torch.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
from dataclasses import dataclass

#: Optional packages whose presence changes what fw can do. Probed without importing them.
OPTIONAL_PACKAGES = ("triton", "flashinfer", "gguf", "xgrammar", "litestar", "zmq", "mcp")


@dataclass(frozen=True, slots=True)
class Platform:
    """A description of the current machine that plugins use to decide what they register.

    ``device_type`` is ``"cuda"`` or ``"cpu"``. ``compute_capability`` is ``(major, minor)``
    of device 0, or ``None`` on CPU or when the device was not probed. ``packages`` maps each
    name in :data:`OPTIONAL_PACKAGES` to whether it is importable. ``probed`` says whether torch
    was asked (``False`` means the device fields are a filesystem guess).
    """

    device_type: str
    num_devices: int = 0
    device_name: str | None = None
    compute_capability: tuple[int, int] | None = None
    packages: frozenset[str] = frozenset()
    probed: bool = False

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def has_package(self, name: str) -> bool:
        """True if the optional package ``name`` can be imported here."""
        if name in OPTIONAL_PACKAGES:
            return name in self.packages
        return importlib.util.find_spec(name) is not None

    def describe(self) -> str:
        """One line for start-up summaries and ``fw plugins check``."""
        if self.is_cuda:
            cc = ".".join(map(str, self.compute_capability)) if self.compute_capability else "?"
            return f"cuda x{self.num_devices} ({self.device_name or 'unknown'}, sm {cc})"
        return "cpu"


def _probe_packages() -> frozenset[str]:
    return frozenset(name for name in OPTIONAL_PACKAGES if importlib.util.find_spec(name) is not None)


@functools.cache
def detect_platform(probe_device: bool = True) -> Platform:
    """Describe this machine; with ``probe_device`` torch is imported to ask CUDA."""
    packages = _probe_packages()
    if not probe_device:
        num = len(glob.glob("/dev/nvidia[0-9]*"))
        return Platform("cuda" if num else "cpu", num_devices=num, packages=packages)
    import torch

    if not torch.cuda.is_available():
        return Platform("cpu", packages=packages, probed=True)
    return Platform(
        "cuda",
        num_devices=torch.cuda.device_count(),
        device_name=torch.cuda.get_device_name(0),
        compute_capability=torch.cuda.get_device_capability(0),
        packages=packages,
        probed=True,
    )


def platform_for_device(device_type: str | None = None) -> Platform:
    """The platform that code placed on ``device_type`` runs on: this machine's
    (:func:`detect_platform`), except that a ``"cpu"`` device on a CUDA machine gets a CPU
    platform with the same packages, so a model on the CPU never selects a CUDA-only kernel or
    backend. ``None`` means the machine's default device."""
    platform = detect_platform()
    if device_type == "cpu" and platform.is_cuda:
        return Platform("cpu", packages=platform.packages, probed=True)
    return platform
