"""Build and load ``cpu_kernels.cpp`` (the packed GGUF CPU kernels) once per machine.

The source is compiled with the system C++ compiler (``$CXX``, else ``g++``) for this CPU's
instruction set into ``$FW_CACHE_DIR/gguf_cpu/<key>/`` (default ``~/.cache/fw``), where ``key``
hashes the source, the flags and the CPU's feature flags, so an edited file or another CPU builds
anew and a shared home directory never hands one machine another's binary. Concurrent processes
(the API and engine processes, parallel tests) build into private temporaries and rename: the
first finished wins, none sees a half-written library. The library links the OpenMP runtime that
torch already loaded (same ``libgomp.so.1``), so both share one thread pool.

:func:`load_kernels` returns the loaded :class:`ctypes.CDLL`, or ``None`` with the reason logged
once when no compiler is there or the build fails (the caller then dequantizes at load).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-shared",
    "-fPIC",
    "-std=c++17",
)
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cache_path() -> Path:
    """Where this machine's build of the current source lives."""
    compiler = os.environ.get("CXX", "g++")
    key = hashlib.sha256(
        b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    root = Path(os.environ.get("FW_CACHE_DIR", Path.home() / ".cache" / "fw"))
    return root / "gguf_cpu" / key / "libfw_gguf_cpu.so"


def _build(target: Path) -> None:
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler {compiler!r} on PATH (set CXX, or install g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so.partial", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(partial)], capture_output=True, text=True, timeout=300
        )
        if result.returncode:
            raise RuntimeError(f"{compiler} failed building {SOURCE.name}:\n{result.stderr[-2000:]}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


@functools.cache
def load_kernels() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use), or None when they cannot be built here."""
    import torch  # noqa: F401  (loads torch's libgomp first, so the library links to the same runtime)

    target = cache_path()
    try:
        if not target.exists():
            logger.info("building the GGUF CPU kernels into %s", target)
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("GGUF CPU kernels unavailable, GGUF weights will be dequantized at load: %s", error)
        return None
    lib.fw_gguf_matmul.argtypes = [_INT, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _INT]
    lib.fw_gguf_dequantize.argtypes = [_INT, _PTR, _I64, _I64, _PTR, _INT]
    lib.fw_gguf_matmul.restype = lib.fw_gguf_dequantize.restype = _INT
    return lib
