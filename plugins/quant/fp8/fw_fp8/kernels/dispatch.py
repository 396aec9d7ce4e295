"""Which FP8 matmul serves a call: the thresholds in one place, the device capability read once per layer.

::

    no FP8 tensor cores (below sm_89)                               -> w8a16        (Triton, any weight layout)
    rows <= SMALL_MAX_ROWS                                          -> w8a8_block   (Triton, 1x128 activation groups,
                                                                                     split-K where N is small)
    more rows, channel / tensor weights, bf16, N and K % 16 == 0    -> scaled_mm    (torch._scaled_mm, row-wise)
    more rows, other weights                                        -> w8a8_block
    CPU (no Triton interpreter)                                     -> torch        (dequantize, then F.linear)

Within a path the kernel's settings follow the rows and the shape too: the W8A8 block GEMM's tiles and
split-K come from :func:`fw_fp8.kernels.w8a8_block.choose_config` (a table measured per GPU model for
the decode rows, :mod:`fw_fp8.kernels.w8a8_tuned`, else a rule), W8A16's from
:func:`fw_fp8.kernels.w8a16.choose_config`; :func:`w8a8_settings` lists what a layer can launch.

``FW_FP8_KERNEL`` forces a family: ``auto`` (the table), ``w8a16`` (every call), ``w8a8`` (the W8A8
kernels for every row count; refused below sm_89, and on the CPU unless ``TRITON_INTERPRET=1``, where
the interpreter runs them for tests: ``auto`` keeps W8A16 there, as below sm_89).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from framework.errors import ConfigError

#: Up to this many rows the W8A8 block GEMM serves every weight granularity where FP8 tensor cores are.
#: On the H200 (6ef8f97, ``benchmarks/fp8_kernels.py``, block weights) it beat the W8A16 kernel at every
#: row count timed: a Llama-3-8B layer's four matmuls took 139 / 132 / 162 us at 1 / 16 / 64 rows against
#: W8A16's 197 / 199 / 204 and ``_scaled_mm``'s 189 / 213 / 210; at 512 rows ``_scaled_mm`` took 392 us,
#: W8A8 453. W8A16 serves GPUs without FP8 tensor cores and ``FW_FP8_KERNEL=w8a16``.
SMALL_MAX_ROWS = 64
#: The first compute capability with FP8 tensor cores (Ada).
FP8_TENSOR_CORE_CAPABILITY = (8, 9)
KERNEL_CHOICES = ("auto", "w8a16", "w8a8")


def requested_kernel() -> str:
    """``FW_FP8_KERNEL`` (default ``auto``), refused with a ConfigError when it is not a choice."""
    choice = os.environ.get("FW_FP8_KERNEL", "auto").strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise ConfigError(f"FW_FP8_KERNEL={choice!r} is not a choice; valid: {', '.join(KERNEL_CHOICES)}")
    return choice


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` multiplies FP8 on tensor cores (CUDA sm_89+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_TENSOR_CORE_CAPABILITY


def can_run_w8a8(device: torch.device) -> bool:
    """FP8 tensor cores, or the CPU under the Triton interpreter (which emulates them)."""
    return has_fp8_tensor_cores(device) or (device.type == "cpu" and interpreting())


def check_requested_kernel(device: torch.device) -> None:
    """Refuse ``FW_FP8_KERNEL=w8a8`` where no FP8 tensor cores are, naming what runs there."""
    if requested_kernel() == "w8a8" and not can_run_w8a8(device):
        where = (
            f"this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"
            if device.type == "cuda"
            else f"{device.type} has no FP8 tensor cores (TRITON_INTERPRET=1 emulates them)"
        )
        raise ConfigError(
            f"FW_FP8_KERNEL=w8a8 needs FP8 tensor cores (CUDA sm_89+: Ada, Hopper, Blackwell); {where}; "
            "supported here: FW_FP8_KERNEL=w8a16 or auto (FP8 weights, 16-bit activations)"
        )


class Fp8Paths(NamedTuple):
    """A layer's matmul for few rows (``small``) and for more (``large``)."""

    small: str
    large: str

    def choose(self, rows: int) -> str:
        return self.small if rows <= SMALL_MAX_ROWS else self.large


def choose_paths(device: torch.device, weights: str, dtype: torch.dtype, n: int, k: int) -> Fp8Paths:
    """The paths of a layer with ``weights`` granularity (``block`` / ``channel`` / ``tensor``), ``[n, k]``,
    activations in ``dtype``, on ``device``."""
    if device.type != "cuda" and not interpreting():
        return Fp8Paths("torch", "torch")
    choice = requested_kernel()
    if choice == "w8a8" and can_run_w8a8(device):
        pass
    elif choice == "w8a16" or not has_fp8_tensor_cores(device):
        return Fp8Paths("w8a16", "w8a16")
    if weights != "block" and device.type == "cuda" and dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0:
        return Fp8Paths("w8a8_block", "scaled_mm")
    return Fp8Paths("w8a8_block", "w8a8_block")


def w8a8_settings(n: int, k: int, num_sms: int, device_name: str) -> list[dict[str, int]]:
    """The distinct W8A8 block settings a layer ``[n, k]`` launches for ``rows <= SMALL_MAX_ROWS`` and
    above (a representative of each row bucket of the rule, and every tuned row count): the compile
    test builds each for sm_90."""
    from .w8a8_block import choose_config  # Triton: imported only where kernels run

    settings = []
    for rows in (1, 2, 4, 8, 16, 32, 64, SMALL_MAX_ROWS * 2):
        setting = choose_config(rows, n, k, num_sms, device_name)
        if setting not in settings:
            settings.append(setting)
    return settings
